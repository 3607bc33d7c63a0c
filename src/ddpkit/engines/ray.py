"""`ddpkit ray` and `ddpkit.train_on_ray`: a ddpkit run inside Ray Train's workers.

Ray places the workers and makes their process group (a TorchTrainer over gloo or NCCL); each
worker runs what `ddpkit train` runs in a worker started by an outside launcher (api.train:
DistEnv finds the Ray environment, environments/ray.py, and the Runtime takes Ray's group).
So the model, the checkpoints in RUN_DIR and the data position (in samples) are ddpkit's, as
with `ddpkit train` at the same global batch. A worker that fails or dies makes Ray restart
the whole group (FailureConfig(max_failures) = --max-restarts); every attempt trains with
--auto-resume, so a restarted group continues from RUN_DIR's newest checkpoint. RUN_DIR must be
on storage every node sees (check_run_dir_shared). The driver (this process) turns Ray's
failure into ddpkit's one line: the worker's refusal, or the rank that raised or died first.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import NODES
from ..config.file import FIELDS
from ..config.launch import LaunchTable
from ..config.settings import flag_spellings
from ..errors import DdpkitError, Interrupted, RunDirTaken, WorkerFailed
from ..util.envvars import LAUNCH_TIME_VAR
from .job import check_run_dir_shared, job_description, run_dir_of
from .slurm import SLURM_PLACES, config_of, with_config_file

RAY_DIR = "ray"  # RUN_DIR/ray: Ray Train's own files of the run (its RunConfig's storage_path/name)
REFUSED_FILE = "refused.txt"  # RUN_DIR/ray/refused.txt: a worker's refusal, which no restart can change
ATTEMPT_FILE = "attempt"  # RUN_DIR/ray/attempt: how many times rank 0 has started (1 + the restarts so far)
RAISED_FILE = "raised-{rank}.txt"  # RUN_DIR/ray/raised-R.txt: the last lines of rank R's traceback
LAST_LINES = 12
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}


@dataclass(frozen=True)
class RayJob:
    """What Ray Train is asked for: the workers (one per GPU on GPU nodes) and how to place
    them, the cluster, how often to restart the group, and the process group Ray makes."""

    workers: int
    nodes: int | None = None  # None: wherever Ray finds room
    workers_per_node: int | None = None
    gpus_per_node: int = 0
    cpus_per_worker: int | None = None
    address: str | None = None  # None: RAY_ADDRESS, a running local Ray, or a new one
    max_failures: int = 0
    backend: str | None = None  # None: Ray's choice (NCCL with GPUs, gloo without)
    timeout_s: int = 1800

    @property
    def device_type(self) -> str:
        return "cuda" if self.gpus_per_node else "cpu"

    @property
    def placement(self) -> str:
        """Ray's placement strategy: every worker on one node, one per node, or spread."""
        if self.nodes == 1:
            return PLACEMENTS["strict_pack"]
        if self.nodes and self.workers == self.nodes:
            return PLACEMENTS["strict_spread"]
        return PLACEMENTS["spread"] if self.nodes else PLACEMENTS["pack"]

    @property
    def resources(self) -> dict[str, float] | None:
        """Each worker's Ray resources beyond Ray's default (1 CPU, and 1 GPU with use_gpu)."""
        if not self.cpus_per_worker:
            return None
        return {"CPU": float(self.cpus_per_worker), **({"GPU": 1.0} if self.gpus_per_node else {})}

    def describe(self, run_dir: Path) -> str:
        where = f"{self.nodes} node(s)" if self.nodes else "the nodes Ray chooses"
        each = ["1 GPU" if self.gpus_per_node else "no GPU"]
        if self.cpus_per_worker:
            each.append(f"{self.cpus_per_worker} CPU(s)")
        return "\n".join(
            [
                f"ddpkit: Ray Train job (dry run: nothing submitted) on {self.address or 'a local Ray'}",
                f"  {self.workers} worker(s) on {where} (placement {self.placement}); each {', '.join(each)}",
                f"  process group made by Ray: {self.backend or ('nccl' if self.gpus_per_node else 'gloo')}, "
                f"timeout {self.timeout_s} s",
                f"  restarts: {self.max_failures} (--max-restarts); each attempt resumes from {run_dir}",
            ]
        )


def ray_job(launch: LaunchTable, workers: int | None, max_failures: int = 0, backend: str = "auto") -> RayJob:
    """The job from the [launch] table (under the command's flags) and --workers, the workers in
    all: given both, they must agree with nodes x workers_per_node."""
    gpus = launch.gpus_per_node or 0
    if gpus and launch.workers_per_node and launch.workers_per_node > gpus:
        raise DdpkitError(
            f"workers_per_node {launch.workers_per_node} is more than gpus_per_node {gpus}: ddpkit runs one "
            "worker per GPU; drop --workers-per-node"
        )
    per_node = launch.workers_per_node or gpus or None
    if workers is None:
        workers = (launch.nodes or 1) * (per_node or 1)
    elif workers < 1:
        raise DdpkitError(f"--workers must be at least 1, got {workers}")
    elif launch.nodes and per_node and workers != launch.nodes * per_node:
        raise DdpkitError(
            f"--workers {workers} but nodes x workers per node = {launch.nodes} x {per_node} = "
            f"{launch.nodes * per_node}: give one of them, or make them agree"
        )
    nodes = launch.nodes or (-(-workers // per_node) if per_node and launch.workers_per_node else None)
    if nodes and nodes > workers:
        raise DdpkitError(f"{nodes} node(s) for {workers} worker(s): each node runs at least one; lower --nodes")
    if nodes and workers % nodes:
        raise DdpkitError(f"{workers} worker(s) do not divide evenly over {nodes} node(s): change --workers or --nodes")
    return RayJob(
        workers=workers,
        nodes=nodes,
        workers_per_node=(workers // nodes) if nodes else per_node,
        gpus_per_node=gpus,
        cpus_per_worker=launch.cpus_per_worker,
        address=launch.address,
        max_failures=max_failures,
        backend=None if backend == "auto" else backend,
    )


def ray_command(
    opts: Any, command_line: str, parse_train: Callable[[list[str]], Any], train_config: Callable[[Any], Any]
) -> int:
    """`ddpkit ray` with its options `opts` (cli/ray_cmd.py's RayOptions): the arguments after -- are
    `ddpkit train`'s (`parse_train` parses them, `train_config` makes their RunConfig), the job is
    the config file's [launch] table under the command's flags. Ray writes no file a command line
    could head, so `command_line` goes unused."""
    del command_line
    args = with_config_file(list(opts.train_args or ()), opts.config)
    try:
        train = parse_train(args)
    except SystemExit:
        raise DdpkitError(
            "the arguments after -- are not valid `ddpkit train` arguments (see the message above)"
        ) from None
    refuse_placement(train)  # before the values' own checks: --nnodes 2 is Ray's, not a question of --master-addr
    table = job_description(
        config_of(args),
        nodes=opts.nodes,
        workers_per_node=opts.workers_per_node,
        gpus_per_node=opts.gpus_per_node,
        cpus_per_worker=opts.cpus_per_worker,
        address=opts.address,
        job_name=opts.job_name,
        shared_run_dir=opts.shared_run_dir or None,
    )
    run_ray_job(train_config(train), table, opts.workers, opts.dry_run or train.dry_run)
    return 0


# Where the workers run: Ray's. Every setting of the node group, not only those SLURM refuses
RAY_PLACES = (*SLURM_PLACES, *(n for n, f in FIELDS.items() if f.metadata["group"] == NODES and n not in SLURM_PLACES))


def refuse_placement(cfg: Any) -> None:
    """Ray places the workers: a training setting that says where they run (--nproc, --nnodes,
    --master-addr, ...; flag or config file) is refused in one line, not silently ignored."""
    for name in RAY_PLACES:
        if getattr(cfg, name, FIELDS[name].default) != FIELDS[name].default:
            flag = flag_spellings(FIELDS[name])[0]
            raise DdpkitError(
                f"{flag} does not belong in a Ray job: Ray places the workers (use --workers, "
                "--nodes and --workers-per-node of `ddpkit ray`, or the [launch] table)"
            )


def train_on_ray(
    config: Any = None,
    *,
    workers: int | None = None,
    address: str | None = None,
    launch: LaunchTable | str | None = None,
    dry_run: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """Train `config` (a RunConfig, with `overrides`) in `workers` Ray Train workers on the Ray
    cluster at `address` (default: [launch] address, RAY_ADDRESS, else a local Ray) and return
    rank 0's summary. `launch`: the job's [launch] table, or a config file to read it from.
    Restarts: --max-restarts (`max_restarts`), each resuming from the run directory."""
    from ..config import RunConfig

    cfg = (config or RunConfig()).replace(**overrides) if overrides else (config or RunConfig())
    table = job_description(launch) if isinstance(launch, str) else (launch or LaunchTable())
    if address is not None:
        table = dataclasses.replace(table, address=address)
    return run_ray_job(cfg, table, workers, dry_run)


def run_ray_job(cfg: Any, table: LaunchTable, workers: int | None, dry_run: bool) -> dict[str, Any]:
    """The driver: check everything `ddpkit train` checks before a worker starts, then submit."""
    from ..run.train import _check_strategy, _check_task_exists, _missing_folders, failure_recorded, prepare_local_run

    refuse_placement(cfg)
    job = ray_job(table, workers, cfg.max_restarts, cfg.backend)
    _check_strategy(cfg, job.device_type, job.workers)
    _check_task_exists(cfg)
    run_dir = Path(run_dir_of(table, cfg.run_dir) or default_ray_run_dir(cfg, table)).resolve()
    check_run_dir_shared(run_dir, dataclasses.replace(table, nodes=job.nodes), "Ray", dry_run=dry_run)
    cfg = cfg.replace(run_dir=str(run_dir), task=absolute_task(cfg.task))
    if dry_run:
        print(job.describe(run_dir))
        return {"plan": dataclasses.asdict(job)}
    _import_ray()  # before the run directory is made
    made = _missing_folders(str(run_dir))
    cfg = prepare_local_run(cfg)  # refuses a folder that holds a run, unless --resume / --auto-resume
    with failure_recorded(str(run_dir), made=made):
        submit(job, cfg, table, run_dir)
    return read_summary(run_dir)


def default_ray_run_dir(cfg: Any, table: LaunchTable) -> Path:
    """runs/JOB_NAME-TIME with a [launch] job_name (or --job-name), else `ddpkit train`'s default."""
    from ..run.train import default_run_dir

    if table.job_name:
        return Path("runs") / f"{table.job_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return default_run_dir(cfg)


def absolute_task(task: str) -> str:
    """A task in a file (path/to/file.py:FUNCTION) by its absolute path: Ray's workers start in
    a folder of their own."""
    path, sep, function = task.rpartition(":")
    if sep and path.endswith(".py") and Path(path).is_file():
        return f"{Path(path).resolve()}:{function}"
    return task


def submit(job: RayJob, cfg: Any, table: LaunchTable, run_dir: Path) -> None:
    """Connect to Ray (or start a local one), run the TorchTrainer to its end, and turn a failure
    into ddpkit's one line. A local Ray started here is shut down again."""
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=job.address, log_to_driver=True, configure_logging=False)
    refused = run_dir / RAY_DIR / REFUSED_FILE
    for left in (refused, run_dir / RAY_DIR / ATTEMPT_FILE, *(run_dir / RAY_DIR).glob(RAISED_FILE.format(rank="*"))):
        left.unlink(missing_ok=True)  # an earlier run's are not this one's
    try:
        check_cluster(job, table, run_dir, ray)
        trainer = make_trainer(job, cfg, run_dir)
        try:
            trainer.fit()
        except Exception as e:
            if isinstance(e, DdpkitError):
                raise
            raise job_error(e, refused, job.max_failures) from None
    finally:
        refused.unlink(missing_ok=True)
        if started:
            ray.shutdown()


def check_cluster(job: RayJob, table: LaunchTable, run_dir: Path, ray: Any) -> None:
    """Without a node count, Ray may spread the workers over every node of the cluster: the run
    directory must then be shared as for a job that names its nodes."""
    if job.nodes is not None or job.workers < 2:
        return
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    if alive > 1:
        check_run_dir_shared(run_dir, dataclasses.replace(table, nodes=min(alive, job.workers)), "Ray")


def make_trainer(job: RayJob, cfg: Any, run_dir: Path) -> Any:
    """The TorchTrainer whose every worker runs `ray_worker` over the run's settings."""
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    worker_cfg = cfg.replace(auto_resume=True, resume=False, max_restarts=0)  # every attempt continues RUN_DIR
    loop = {
        "run": worker_cfg.as_dict(),
        "cwd": os.getcwd(),
        "launch_time": os.environ.get(LAUNCH_TIME_VAR) or repr(time.time()),
        "max_failures": job.max_failures,
    }
    return TorchTrainer(
        ray_worker,
        train_loop_config=loop,
        scaling_config=ScalingConfig(
            num_workers=job.workers,
            use_gpu=bool(job.gpus_per_node),
            resources_per_worker=job.resources,
            placement_strategy=job.placement,
        ),
        torch_config=TorchConfig(backend=job.backend, timeout_s=int(cfg.timeout)),
        run_config=RunConfig(
            name=RAY_DIR,
            storage_path=str(run_dir),
            failure_config=FailureConfig(max_failures=job.max_failures),
            logging_config=LoggingConfig(log_level="INFO" if cfg.verbose else "ERROR"),  # Ray's own lines
        ),
    )


def ray_worker(loop: dict[str, Any]) -> None:
    """Ray Train's train function, in every worker: the run as an outside launcher's worker runs
    it (api.train: DistEnv finds Ray, the Runtime takes the group Ray made). It starts where the
    command was given, when that folder is here too (relative paths mean what they meant there).
    A refusal is written for the attempts Ray may start after it: they refuse at once."""
    from ..config import RunConfig
    from ..run.train import train

    if os.path.isdir(loop["cwd"]):
        os.chdir(loop["cwd"])
    os.environ[LAUNCH_TIME_VAR] = loop["launch_time"]
    ranks_from_context()
    refused = Path(loop["run"]["run_dir"]) / RAY_DIR / REFUSED_FILE
    if refused.is_file():
        raise DdpkitError(refused.read_text().strip())
    if os.environ["RANK"] == "0":
        say_attempt(Path(loop["run"]["run_dir"]), loop["max_failures"])
    try:
        train(RunConfig.from_dict(loop["run"]))
    except DdpkitError as e:
        if not isinstance(e, (WorkerFailed, RunDirTaken, Interrupted)):  # the user's input: the same next time
            refused.parent.mkdir(parents=True, exist_ok=True)
            refused.write_text(str(e))
        raise
    except Exception as e:
        keep_last_lines(refused.parent / RAISED_FILE.format(rank=os.environ["RANK"]), e)
        raise


def keep_last_lines(path: Path, e: BaseException) -> None:
    """The last lines of this rank's traceback, in the shared run directory: the driver shows
    them for the rank it names (Ray's forwarding of a worker's output is best effort)."""
    import traceback

    from ..util.textfile import write_text_atomic

    lines = "".join(traceback.format_exception(e)).rstrip().splitlines()[-LAST_LINES:]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, "\n".join(lines) + "\n")
    except OSError:
        pass  # the error itself still reaches the driver


def say_attempt(run_dir: Path, max_failures: int) -> None:
    """Rank 0 counts the attempts Ray started and says each restart, as `ddpkit train`'s launcher does."""
    path = run_dir / RAY_DIR / ATTEMPT_FILE
    try:
        attempt = int(path.read_text()) + 1
    except (OSError, ValueError):
        attempt = 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(attempt))
    if attempt > 1:
        print(
            f"ddpkit: Ray restarted the workers after a failure (restart {attempt - 1} of {max_failures}, "
            f"--max-restarts): they resume from the newest checkpoint in {run_dir}",
            flush=True,
        )


def ranks_from_context() -> None:
    """torch's variables from Ray Train's context, where Ray did not set them (its older worker
    groups set them only as training starts): what environments/ray.py reads."""
    if all(v in os.environ for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return
    import ray.train

    context = ray.train.get_context()
    os.environ.update(
        RANK=str(context.get_world_rank()),
        LOCAL_RANK=str(context.get_local_rank()),
        WORLD_SIZE=str(context.get_world_size()),
        LOCAL_WORLD_SIZE=str(context.get_local_world_size()),
        NODE_RANK=str(context.get_node_rank()),
    )


def job_error(e: BaseException, refused: Path, max_failures: int) -> DdpkitError:
    """ddpkit's one line for Ray's failure `e`: a worker's refusal (exit 2); else the rank whose
    own error or death ended the job, not the ranks that only lost contact with it (exit 1)."""
    from ..run.worker import another_rank_failed, exception_line

    if refused.is_file():
        return DdpkitError(refused.read_text().strip())
    failures: dict[int, BaseException] = dict(getattr(e, "worker_failures", None) or {})
    if not failures:
        return WorkerFailed(f"the Ray job failed: {exception_line(_cause(e))}")
    ddpkit = {r: f for r, f in failures.items() if isinstance(f, DdpkitError)}
    if ddpkit:
        return ddpkit[min(ddpkit)]
    own = {r: f for r, f in failures.items() if not _died(f) and another_rank_failed(f) is None}
    died = {r: f for r, f in failures.items() if _died(f)}
    restarts = f" (after {max_failures} restart(s), --max-restarts)" if max_failures else ""
    if own:
        rank = min(own)
        above = " (its last lines are above)" if said_last_lines(refused.parent, rank) else ""
        return WorkerFailed(
            f"worker rank {rank} raised {exception_line(own[rank])}; the other workers were stopped{restarts}{above}"
        )
    if died:
        rank = min(died)
        return WorkerFailed(f"worker rank {rank} died ({_death(died[rank])}); the other workers were stopped{restarts}")
    rank = min(failures)
    return WorkerFailed(f"worker rank {rank} failed: {exception_line(failures[rank])}{restarts}")


def said_last_lines(ray_dir: Path, rank: int) -> bool:
    """Print the last lines of rank `rank`'s traceback (keep_last_lines), where it left them."""
    try:
        lines = (ray_dir / RAISED_FILE.format(rank=rank)).read_text().splitlines()
    except OSError:
        return False
    print(f"ddpkit: rank {rank}'s last lines:", *(f"  {line}" for line in lines), sep="\n", file=sys.stderr, flush=True)
    return True


def _died(failure: BaseException) -> bool:
    """A worker whose process ended without an exception of its own (killed, crashed, lost node)."""
    names = {type(x).__name__ for x in (failure, getattr(failure, "health_check_failure", None)) if x is not None}
    return bool(names & {"WorkerHealthCheckFailedError", "RayActorError", "ActorDiedError", "ActorUnavailableError"})


def _death(failure: BaseException) -> str:
    text = str(getattr(failure, "health_check_failure", None) or failure)
    for hint in ("SIGKILL", "SIGSEGV", "killed", "exit", "OOM", "node"):
        for line in text.splitlines():
            if hint in line:
                return line.strip()[:200]
    return (text.strip().splitlines() or ["its process ended"])[0][:200]


def _cause(e: BaseException) -> BaseException:
    """The innermost exception Ray wrapped `e` around."""
    seen = e
    for _ in range(10):
        inner = seen.__cause__ or getattr(seen, "controller_failure", None)
        if inner is None:
            break
        seen = inner
    return seen


def read_summary(run_dir: Path) -> dict[str, Any]:
    """Rank 0's summary.json (written in RUN_DIR); {} where this machine does not see the folder."""
    import json

    path = run_dir / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        print(f"ddpkit: the run's summary is in {path} where the workers ran", file=sys.stderr, flush=True)
        return {}


def _import_ray() -> Any:
    try:
        import ray
        import ray.train  # noqa: F401  (its extra: ray[train])
    except ImportError:
        raise DdpkitError("`ddpkit ray` needs Ray Train: pip install 'ddpkit[ray]' (or 'ray[train]')") from None
    return ray
