"""Where the sampler/trainer mismatch comes from, per component (issue #47, item 3).

    .venv/bin/python research/mismatch_layers.py STORE_ROOT RUN_ID [--steps 1 2 3] [--flips-only] [--json F]

Per step, the trajectories vLLM sampled are scored again (as research/mismatch.py does) by variants
of the trainer's model that differ in which components run in bf16:
    fp32            everything fp32 (the CPU trainer's default)
    bf16            everything bf16 on the bf16 rounding of the weights (optimizer.precision=bf16;
                    equal to runtime._bf16_forward): residual stream, norms, logits in bf16
    +COMPONENT      fp32, but COMPONENT's modules run in bf16: weights rounded, inputs cast to bf16,
                    outputs cast back to fp32 (hooks), so the residual stream stays fp32
    +all            every component so; what separates it from bf16 is the bf16 residual stream
    bf16-COMPONENT  bf16, but COMPONENT in fp32 (fp32 weights and compute, output rounded to bf16,
                    except lm_head's: fp32 logits, as vLLM's --hf-overrides head_dtype=float32 gives)
COMPONENTs: gdn (the Gated DeltaNet `linear_attn` modules, their gated norm included), attn
(`self_attn`, q/k norms included), router (`mlp.gate`), experts (`mlp.experts`), shared
(`mlp.shared_expert` + `mlp.shared_expert_gate`), embed, norms (the decoder's RMSNorms and the
final one), lm_head. transformers' torch GDN kernel (torch_chunk_gated_delta_rule) casts q, k, v,
g, beta to fp32 and keeps the recurrent state in fp32 whatever the module's dtype, so "gdn" in bf16
is its projections, conv and gated norm in bf16; its recurrence is fp32 in every variant.

For each variant, against vLLM's logprobs: token_mult_prob_error, |d| mean/max, masked (as in
mismatch.py); against the fp32 variant: |d| mean/max.

Router flips: the share of (position, MoE layer) pairs whose top-k expert set differs from the
fp32 forward's, in the bf16 forward and in fp32 compute on the bf16-rounded weights (fp32-bf16w),
per layer; every position of every trajectory (prompt included), one sequence per forward.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from research.mismatch import stats, step_models  # noqa: E402

COMPONENTS = ("gdn", "attn", "router", "experts", "shared", "embed", "norms", "lm_head")


def component(name: str) -> str | None:
    """The component a module (by its qualified name) is, or None (its parts, or a container)."""
    last = name.rsplit(".", 1)[-1]
    if last == "linear_attn":
        return "gdn"
    if last == "self_attn":
        return "attn"
    if name.endswith("mlp.gate"):
        return "router"
    if name.endswith("mlp.experts"):
        return "experts"
    if name.endswith(("mlp.shared_expert", "mlp.shared_expert_gate")):
        return "shared"
    if last == "embed_tokens":
        return "embed"
    if last in ("input_layernorm", "post_attention_layernorm") or name == "model.norm":
        return "norms"
    if name == "lm_head":
        return "lm_head"
    return None


def _cast(x, dtype):
    if hasattr(x, "is_floating_point") and x.is_floating_point():
        return x.to(dtype)
    if isinstance(x, tuple):
        return tuple(_cast(v, dtype) for v in x)
    return x


def variant(model, base: str = "fp32", other: tuple[str, ...] = ()):
    """A copy of the fp32 `model` computing in `base` ("fp32" or "bf16": every parameter rounded to
    bf16, the residual stream in bf16, as runtime._bf16_forward), with the components in `other`
    computed in the other precision: their own weights in it, their floating inputs cast to it, their
    outputs cast back to `base` (lm_head's output, the logits, is left as computed). Tied weights are
    untied in the copy, so that embed and lm_head can differ."""
    import torch

    low, high = torch.bfloat16, torch.float32
    base_dt, other_dt = (high, low) if base == "fp32" else (low, high)
    m = copy.deepcopy(model)

    def set_params(mod, src, dtype):
        for sub_name, sub in mod.named_modules():
            for n, p in list(sub.named_parameters(recurse=False)):
                w = src.get_submodule(sub_name).get_parameter(n) if src is not None else p
                setattr(sub, n, torch.nn.Parameter(w.detach().to(dtype), requires_grad=False))

    def to_other(_m, args, kwargs):  # masks keep their dtype: fp32 min cast to bf16 overflows to -inf
        return _cast(args, other_dt), {k: v if k == "attention_mask" else _cast(v, other_dt) for k, v in kwargs.items()}

    if base == "bf16":
        set_params(m, None, low)  # buffers (rotary inv_freq) stay fp32, as under functional_call
    for name, mod in list(m.named_modules()):
        if component(name) not in other:
            continue
        set_params(mod, model.get_submodule(name), other_dt)
        mod.register_forward_pre_hook(to_other, with_kwargs=True)
        if name != "lm_head":
            mod.register_forward_hook(lambda _m, _a, out: _cast(out, base_dt))
    return m


def variants(model) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (base, other components) for the components this model has."""
    names = [n for n, _ in model.named_modules()]
    have = [c for c in COMPONENTS if any(component(n) == c for n in names)]
    out = {"fp32": ("fp32", ()), "bf16": ("bf16", ())}
    out.update({f"+{c}": ("fp32", (c,)) for c in have})
    out["+all"] = ("fp32", tuple(have))
    out.update({f"bf16-{c}": ("bf16", (c,)) for c in ("gdn", "router", "lm_head") if c in have})
    return out


def routes(model, token_ids: list[list[int]]) -> list:
    """Per MoE layer, the sorted top-k expert ids [positions, k] over all sequences (one per forward)."""
    import torch

    gates = [mod for n, mod in model.named_modules() if component(n) == "router"]
    got: list[list] = [[] for _ in gates]
    hooks = [g.register_forward_hook(lambda _m, _a, out, i=i: got[i].append(out[2].sort(-1).values))
             for i, g in enumerate(gates)]
    model.eval()
    with torch.no_grad():
        for ids in token_ids:
            model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return [torch.cat(r) for r in got]


def flips(model, token_ids) -> dict[str, list[float]]:
    """Per MoE layer, the share of positions whose top-k set differs from the fp32 forward's."""
    ref = routes(model, token_ids)
    out = {}
    bf16w = copy.deepcopy(model)
    for p in bf16w.parameters():
        p.data = p.data.bfloat16().float()
    for name, m in (("bf16", variant(model, "bf16")), ("fp32-bf16w", bf16w)):
        out[name] = [float((a != b).any(-1).float().mean()) for a, b in zip(ref, routes(m, token_ids))]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("run_id")
    p.add_argument("--steps", type=int, nargs="*")
    p.add_argument("--flips-only", action="store_true", help="only the router flips")
    p.add_argument("--json", help="write the rows here too")
    a = p.parse_args(argv)

    from tasks.policy.runtime import policy_logprobs

    rows = []
    for step, cfg, seqs, model in step_models(a.store, a.run_id, a.steps):
        ids, temp = [s[0] for s in seqs], cfg.agent.training.temperature
        arch, sampler = model.config.model_type, cfg.inference.dtype or "float32"
        if not a.flips_only:
            print(f"step {step} ({arch}, sampler {sampler}, {len(seqs)} seqs)\n"
                  f"  {'variant':<14} {'tmpe':>8} {'|d| mean':>9} {'|d| max':>9} {'masked':>7}"
                  f" | vs fp32: {'|d| mean':>9} {'|d| max':>9}", flush=True)
            fp32 = None
            for name, (base, other) in variants(model).items():
                lp = policy_logprobs(variant(model, base, other), ids, temperature=temp)
                fp32 = lp if fp32 is None else fp32
                v, f = stats(seqs, lp), stats(seqs, lp, ref=fp32)
                rows.append({"step": step, "arch": arch, "sampler": sampler, "variant": name, "vs_vllm": v,
                             "vs_fp32": f})
                print(f"  {name:<14} {v['token_mult_prob_error']:8.5f} {v['abs_diff_mean']:9.2e} "
                      f"{v['abs_diff_max']:9.2e} {v['masked']:7.1%} | vs fp32: {f['abs_diff_mean']:9.2e} "
                      f"{f['abs_diff_max']:9.2e}", flush=True)
        fl = flips(model, ids)
        rows.append({"step": step, "arch": arch, "router_flips": fl})
        for name, per_layer in fl.items():
            print(f"step {step} ({arch}) router flips vs fp32, {name:<10}: mean {sum(per_layer) / len(per_layer):.2%}"
                  f"  per layer " + " ".join(f"{x:.2%}" for x in per_layer), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
