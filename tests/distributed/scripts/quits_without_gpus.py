"""What the FSDP2 example and minGPT-ddp do on a machine without GPUs: one line, exit 0,
before any process group is joined (after QUIT_AFTER seconds: at once, or after imports)."""
import os
import time

time.sleep(float(os.environ.get("QUIT_AFTER", "0")))
print("this example needs CUDA GPUs; exiting")
