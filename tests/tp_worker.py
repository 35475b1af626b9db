"""Run by tests/test_tp.py under torchrun: one tensor-parallel engine over the given checkpoint.
Rank 0 writes what it generated (greedy, seeded forks, teacher-forced log-probs) as JSON."""

import json
import sys

import torch.distributed as dist

from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.models.loader import load_model


def workload(engine):
    """The same calls the single-process side of the test makes."""
    prompts = [[3 + (7 * i + 5 * j) % 390 for j in range(n)] for i, n in enumerate((9, 21, 14))]
    greedy = engine.generate_sync(prompts + [prompts[1][:17] + [5, 6]], SamplingParams(temperature=0, max_tokens=10,
                                                                                        ignore_eos=True))
    forks = engine.generate_sync([prompts[0]], SamplingParams(n=3, max_tokens=8, seed=11, ignore_eos=True))[0]
    score = engine.score_sync(prompts[2], [7, 8, 9, 10, 11], topk=3)
    return {"greedy": [o.completions[0].token_ids for o in greedy],
            "greedy_logprobs": [o.completions[0].logprobs for o in greedy],
            "forks": [c.token_ids for c in forks.completions], "score": score.logprobs,
            "computed": engine.totals.computed_tokens}


def main(path: str, out: str) -> None:
    dist.init_process_group("gloo")
    lm = load_model(path, device="cpu", tp=True)
    engine = Engine(lm.model, None, EngineConfig(block_size=4, kv_cache_memory=4 * 2**20))
    if dist.get_rank() == 0:
        result = workload(engine)
        result["world"] = dist.get_world_size()
        result["kv_heads_here"] = engine.spec.layers[0].k_shape[0]
        engine.close()
        with open(out, "w") as f:
            json.dump(result, f)
    else:
        engine.follow()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
