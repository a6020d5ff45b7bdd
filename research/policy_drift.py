"""How far GRPO moved the policy (a measurement script, not a test): the relative L2 change of all
weights of each checkpoint of a run against a reference checkpoint, and the largest single change.

    .venv/bin/python research/policy_drift.py BASE_DIR CKPT_DIR [CKPT_DIR ...]

Adam's first step moves every weight by about lr whatever its gradient, so a drift that grows like
the square root of the step count is a random walk: the updates' directions do not agree.
"""

import sys

import torch
from safetensors.torch import load_file


def drift(base: dict, other: dict) -> tuple[float, float, str]:
    num = den = biggest = 0.0
    name = ""
    for k, w in base.items():
        d = other[k].float() - w.float()
        num, den = num + float((d ** 2).sum()), den + float((w.float() ** 2).sum())
        if float(d.abs().max()) > biggest:
            biggest, name = float(d.abs().max()), k
    return (num / den) ** 0.5, biggest, name


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    base = load_file(f"{sys.argv[1]}/model.safetensors")
    for d in sys.argv[2:]:
        rel, biggest, name = drift(base, load_file(f"{d}/model.safetensors"))
        print(f"{d}: relative change {rel:.4%}, largest |dw| {biggest:.2e} ({name})")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
