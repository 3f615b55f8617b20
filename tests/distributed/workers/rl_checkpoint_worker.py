"""torchrun worker: the RL trainer's checkpoints (rl.learner.PolicyLearner.save / load) across layouts.

One launch is one layout (--layout, one of LAYOUTS). With --load DIR it first resumes the checkpoint another
layout wrote there and checks it: every weight equals the saver's (gathered to full tensors on both sides,
exactly), and one optimizer step on the same rollout groups followed by the loss of a further batch equals
the saver's own continuation (AdamW moments and step count carried over). Then it takes one step of its own,
saves into --out/ckpt, and writes what a later layout checks: its full weights and its continuation's loss.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import rl_worker  # noqa: E402
from common import init, reduce_max  # noqa: E402
from rl_worker import config, near_policy, rollout_groups  # noqa: E402

from megatron_composer.data.tokenizer import load_tokenizer  # noqa: E402
from megatron_composer.parallel.layers import full_state_dict  # noqa: E402
from megatron_composer.training.layout import Layout  # noqa: E402
from rl.learner import PolicyLearner  # noqa: E402

LAYOUTS = {"fsdp_ep2": dict(fsdp=True, ep=2), "tp2": dict(tp=2), "tp2_ep2": dict(tp=2, ep=2)}
LR = 1e-3


def groups_of(seed: int, behaviour) -> list[dict]:
    """Rollout groups whose behaviour log-probs come from `behaviour`, the one-rank initial policy: the same
    inputs in every launch."""
    results = rollout_groups(seed, behaviour.mc)
    near_policy(results, behaviour.model, seed + 10)
    return results


def continuation(learner: PolicyLearner, behaviour) -> float:
    """One optimizer step on groups 31, then the loss of groups 32 (no step): what a resumed run does next."""
    results, later = groups_of(31, behaviour), groups_of(32, behaviour)
    learner.step(results, LR)
    samples, _, n_ep = learner.samples(later)
    loss = learner.backward(samples, n_ep)["loss"]
    learner.optimizer.zero_grad()
    return loss


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--tok", required=True)
    ap.add_argument("--layout", required=True, choices=sorted(LAYOUTS))
    ap.add_argument("--load", default="")
    known, rest = ap.parse_known_args()
    rl_worker.TOK = known.tok
    sys.argv = [sys.argv[0], *rest]
    args = init()
    out = Path(args.out)
    tok = load_tokenizer(known.tok)
    cfg = config(str(out / "run"), **LAYOUTS[known.layout])
    learner = PolicyLearner(cfg, tok, Layout(cfg.parallel), torch.device("cpu"))
    groups = learner.layout.groups
    one = config(str(out / "one"))
    behaviour = PolicyLearner(one, tok, Layout(one.parallel, distributed=False), torch.device("cpu"))
    result = {"layout": known.layout}
    if known.load:
        saved = torch.load(Path(known.load) / "full.pt")
        state = learner.load(Path(known.load) / "ckpt" / "checkpoints" / "step_1")
        full = full_state_dict(learner.model, groups)
        errs = {"keys": float(set(full) != set(saved["weights"])),
                "weights": float(any(not torch.equal(full[k], v) for k, v in saved["weights"].items())),
                "state": float(state.get("step") != 1)}
        errs["continuation"] = (abs(continuation(learner, behaviour) - saved["continuation"])
                                / abs(saved["continuation"]))
        result.update(errs=reduce_max(errs), loaded_from=saved["layout"])
        learner = PolicyLearner(cfg, tok, Layout(cfg.parallel), torch.device("cpu"))  # a fresh run of this layout
    learner.step(groups_of(30, behaviour), LR)
    learner.save(str(out / "ckpt"), 1, {"step": 1}, keep_last=0)
    weights = {k: v.clone() for k, v in full_state_dict(learner.model, groups).items()}  # replicated ones alias
    after = continuation(learner, behaviour)  # the saver's own next step, which a resumed run must repeat
    if dist.get_rank() == 0:
        torch.save({"weights": weights, "continuation": after, "layout": known.layout}, out / "full.pt")
        import json

        (out / "results.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
