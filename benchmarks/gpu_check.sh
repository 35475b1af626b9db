#!/usr/bin/env bash
# The GPU checks in one command, for a CUDA machine: the GPU tests (zoo exactness on the GPU, the compiled
# Triton kernels against their references), the kernel benchmark, and the engine against plain
# model.generate loops on checkpoint shapes with random weights (timing only: no weights need to travel).
#
#     benchmarks/gpu_check.sh LOGDIR MODEL_DIR...    (each MODEL_DIR: a config.json and a tokenizer)
#
# Each step has its own time limit and log under LOGDIR, so one failing step leaves the others' figures.
# Environment: STEPS (default "tests kernels engine decode"), WORKLOAD (bench_engine's workload flags).
# "engine" times each shape with CUDA graphs (the default) and without; "decode" runs bench_decode on the
# embedded default (tok/s by batch size, and the torch ops a step dispatches) with graphs on and off.
set -u
out=${1:?usage: gpu_check.sh LOGDIR MODEL_DIR...}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
steps=${STEPS:-tests kernels engine decode}
workload=${WORKLOAD:---questions 4 --initial-tokens 128 --debate-tokens 64}

step() {  # step NAME SECONDS CMD...: run with a limit, log to LOGDIR/NAME.log, report the exit code
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $? ($(tail -n 1 "$out/$name.log" | cut -c1-300))"
}

nvidia-smi -L
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
case " $steps " in *" tests "*)
  step tests 420 python -m pytest -q -x -p no:cacheprovider tests/test_gpu.py ;;
esac
case " $steps " in *" kernels "*)
  step kernels 300 python benchmarks/bench_kernels.py --device cuda ;;
esac
case " $steps " in *" engine "*)
  for m in "$@"; do
    name=$(basename "$m")
    # shellcheck disable=SC2086
    step "engine-$name" 420 python benchmarks/bench_engine.py --model "$m" --random-weights --device cuda \
      --dtype bf16 --batched-baseline $workload
    # shellcheck disable=SC2086
    step "engine-$name-nocascade" 200 python benchmarks/bench_engine.py --model "$m" --random-weights --device cuda \
      --dtype bf16 --cascade off --skip-naive $workload
    # shellcheck disable=SC2086
    step "engine-$name-nographs" 200 python benchmarks/bench_engine.py --model "$m" --random-weights --device cuda \
      --dtype bf16 --engine cuda_graphs=off --skip-naive $workload
  done ;;
esac
case " $steps " in *" decode "*)
  for graphs in auto off; do
    step "decode-graphs-$graphs" 300 python benchmarks/bench_decode.py --dtype bf16 --batches 1,8,32 \
      --engine "cuda_graphs=$graphs"
    step "host-ops-graphs-$graphs" 200 python benchmarks/bench_decode.py --dtype bf16 --host-ops \
      --engine "cuda_graphs=$graphs"
  done ;;
esac
