"""The performance doctor (reporting/advice.py) on injected measurements: every rule fires past
its threshold and only then, never names a setting that was on, and says its number."""

from ddpkit.reporting.advice import (
    DATA_SHARE,
    HOST_BOUND_BUSY,
    MAX_ADVICE,
    OPTIMIZER_SHARE,
    SYNC_SHARE,
    Measured,
    advise,
    measured_of_summary,
)

GIB = 1 << 30


def _split(data=0.0, sync=0.0, opt=0.0, **kw):
    """A step of 1 s: the given shares, compute the rest."""
    return Measured(data_s=data, grad_sync_s=sync, optimizer_s=opt, compute_s=1.0 - data - sync - opt, **kw)


def test_nothing_is_suggested_when_nothing_is_past_its_threshold():
    m = _split(data=0.05, sync=0.05, opt=0.05, gpu_busy=0.95, compile=False, fused_optimizer=False, optimizer="AdamW")
    assert advise(m) == []
    assert advise(Measured()) == []  # nothing measured: nothing said


def test_a_gpu_mostly_idle_names_compile_with_its_busy_share():
    m = _split(gpu_busy=0.35, compile=False)
    assert advise(m) == [
        "GPU busy 35% of the training time: the host is the limit; try --compile (fewer, larger kernels)"
    ]
    assert advise(_split(gpu_busy=HOST_BOUND_BUSY, compile=False)) == []  # at the threshold: busy enough
    assert advise(_split(gpu_busy=0.35, compile=True)) == []  # --compile ran already
    assert advise(_split(gpu_busy=None, compile=False)) == []  # a CPU: no GPU measurement, no rule


def test_data_wait_names_more_loader_workers_where_they_apply():
    m = _split(data=0.30, num_workers=0, cores_per_process=8)
    assert advise(m) == ["data wait 30% of the step: --num-workers 2 (it ran with 0)"]
    assert advise(_split(data=0.30, num_workers=2, cores_per_process=8))[0].startswith(
        "data wait 30% of the step: --num-workers 4"
    )
    assert advise(_split(data=DATA_SHARE * 0.9, num_workers=0)) == []
    assert advise(_split(data=0.30, num_workers=None)) == []  # tensors: the loader's workers do not apply
    assert advise(_split(data=0.30, num_workers=2, cores_per_process=2)) == []  # no more cores to give


def test_a_slow_optimizer_names_the_fused_kernel_unless_it_ran_or_cannot():
    m = _split(opt=0.18, fused_optimizer=False, optimizer="AdamW")
    assert advise(m) == ["optimizer 18% of the step: --fused-optimizer on (one kernel for AdamW)"]
    assert advise(_split(opt=0.18, fused_optimizer=True, optimizer="AdamW")) == []
    assert advise(_split(opt=0.18, fused_optimizer=False, optimizer="Lion")) == []  # not one torch fuses
    assert advise(_split(opt=OPTIMIZER_SHARE * 0.9, fused_optimizer=False, optimizer="AdamW")) == []


def test_an_exposed_gradient_sync_names_accumulation_on_several_ranks_only():
    m = _split(sync=0.25, world_size=4, accumulate=2)
    assert advise(m) == [
        "gradient sync 25% of the step (exposed): --accumulate 4 "
        "(half the syncs; a 2x batch, which changes the results)"
    ]
    with_batch = advise(_split(sync=0.25, world_size=4, accumulate=2, batch_size=32))
    assert with_batch[0].endswith("a 2x batch, which changes the results; --global-batch-size 256 with it keeps them)")
    fixed = advise(_split(sync=0.25, world_size=4, accumulate=2, global_batch_fixed=True))
    assert fixed[0].endswith("(half the syncs; the global batch stays, each micro-batch halves)")  # no result changes
    assert advise(_split(sync=0.25, world_size=1)) == []
    assert advise(_split(sync=SYNC_SHARE * 0.9, world_size=4)) == []


def test_an_empty_device_names_the_batch_that_fits_from_the_activations_per_sample():
    m = Measured(peak_bytes=4 * GIB, device_bytes=141 * GIB, activation_bytes_per_sample=1 * GIB, batch_size=16)
    # (0.9 x 141 - 4) GiB / 1 GiB a sample = 122.9 more: 16 -> 128 (three doublings) fits, 256 would not
    assert advise(m) == [
        "4.0 GiB of 141.0 GiB used: --batch-size 128 fits (activations 1.0 GiB per sample, measured; now 16; "
        "a larger batch changes the results: retune --lr)"
    ]
    half = Measured(peak_bytes=71 * GIB, device_bytes=141 * GIB, activation_bytes_per_sample=GIB, batch_size=16)
    assert advise(half) == []  # past half the device
    assert advise(Measured(peak_bytes=4 * GIB, device_bytes=None, activation_bytes_per_sample=GIB, batch_size=16)) == []
    assert advise(Measured(peak_bytes=4 * GIB, device_bytes=141 * GIB, batch_size=16)) == []  # activations not measured
    tight = Measured(peak_bytes=4 * GIB, device_bytes=10 * GIB, activation_bytes_per_sample=GIB, batch_size=8)
    assert advise(tight) == []  # 5 more samples: no doubling fits


def test_at_most_three_the_largest_loss_first():
    m = _split(
        data=0.30,
        sync=0.25,
        opt=0.18,
        gpu_busy=0.5,
        compile=False,
        num_workers=0,
        cores_per_process=8,
        fused_optimizer=False,
        optimizer="SGD",
        world_size=2,
    )
    lines = advise(m)
    assert len(lines) == MAX_ADVICE
    assert [line.split()[0] for line in lines] == [
        "GPU",
        "data",
        "gradient",
    ]  # 50%, 30%, 25%: the optimizer's 18% is left


def test_a_summary_with_too_few_timed_steps_gives_no_split():
    summary = {
        "time": {"seconds": {"data": 0.3, "compute": 0.1, "grad_sync": 0.0, "optimizer": 0.0}},
        "num_workers": 0,
        "workers_apply": True,
        "cores_per_process": 4,
    }
    assert advise(measured_of_summary(summary)) == []  # 0.4 s of steps: too little to judge
    summary["time"]["seconds"] = {"data": 3.0, "compute": 1.0, "grad_sync": 0.0, "optimizer": 0.0}
    assert advise(measured_of_summary(summary)) == ["data wait 75% of the step: --num-workers 2 (it ran with 0)"]
    summary["workers_apply"] = False
    assert advise(measured_of_summary(summary)) == []


def _wine_like(startup=5.3, steps=(0.2, 0.6, 0.2, 0.1), other=0.4):
    """A run's summary: the default Wine job's shape (measured: 5.3 s of start-up of a 6.2 s wall)."""
    seconds = dict(zip(("data", "compute", "grad_sync", "optimizer"), steps, strict=True))
    seconds.update(startup=startup, eval=0.0, other=other)
    return {
        "time": {"wall_s": startup + sum(steps) + other, "seconds": seconds},
        "world_size": 2,
        "batch_size": 32,
        "num_workers": 0,
        "workers_apply": True,
        "cores_per_process": 4,
    }


def test_a_job_whose_training_is_a_small_part_of_its_wall_gets_what_holds_the_wall_instead():
    summary = _wine_like()  # grad sync 18% of its 1.1 s step, data 18%: the step rules alone would speak
    assert advise(measured_of_summary(summary)) == [
        "training 16% of the wall (1.10 s of 6.80 s): start-up (imports, workers, process group, the task's build) "
        "holds 78% (5.30 s); no setting of the steps would change the wall much"
    ]
    evals = _wine_like(startup=0.5, other=0.2)
    evals["time"]["seconds"]["eval"] = 6.0
    evals["time"]["wall_s"] += 6.0
    assert advise(measured_of_summary(evals))[0].startswith(
        "training 14% of the wall (1.10 s of 7.80 s): eval holds 77%"
    )


def test_a_job_mostly_training_gets_its_step_advice():
    summary = _wine_like(startup=1.0, steps=(3.0, 4.0, 0.5, 0.5), other=0.5)  # training 84% of the wall
    assert advise(measured_of_summary(summary)) == ["data wait 38% of the step: --num-workers 2 (it ran with 0)"]
