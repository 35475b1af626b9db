"""`python -m svrmad_local ...` is the `svrmad` command; launchers start it this way:
`torchrun --nproc-per-node N -m svrmad_local run ...` or
`accelerate launch --multi_gpu --num_processes N -m svrmad_local run ...` (README, "GPUs and several processes")."""

import sys

from svrmad_local.cli import main

sys.exit(main())
