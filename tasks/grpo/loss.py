"""NeMo-RL's clipped policy-gradient loss (`ClippedPGLossFn`), written out in one function.

Every per-token tensor is [B, S-1] and already shifted (position t is the token at
sequence index t+1). mask = token_mask * sample_mask. Reductions divide by *global*
counts (valid tokens / valid sequences of the whole global batch, all ranks and
micro-batches), so the losses and metrics of micro-batches sum to the global batch's.
"""

from __future__ import annotations

import torch

from schemas.config import GRPOConfig


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                global_count: torch.Tensor | float | None = None) -> torch.Tensor:
    """sum(x * mask) / (count + 1e-8), count = global_count or else sum(mask) (along dim)."""
    count = torch.sum(mask, dim=dim) if global_count is None else global_count
    return torch.sum(x * mask, dim=dim) / (count + 1e-8)


def kl_from_log_ratio(log_ratio: torch.Tensor, kind: str) -> torch.Tensor:
    """Schulman's per-token estimators of KL(p || q) from log_ratio = log q - log p (samples from p)."""
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return log_ratio.square() / 2
    if kind == "k3":
        return log_ratio.exp() - 1 - log_ratio
    raise ValueError(f"unknown KL type {kind!r}; use k1, k2 or k3")


def clipped_pg_loss(
    curr_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    global_valid_toks: torch.Tensor | float,
    global_valid_seqs: torch.Tensor | float,
    cfg: GRPOConfig,
    reference_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch (a term of the global-batch loss) and NeMo-RL's metrics dict.

    Gradient flows only through curr_logprobs. advantages is [B, S-1] (a sequence's
    advantage broadcast over its tokens). reference_logprobs is needed when
    cfg.reference_policy_kl_penalty > 0.

    The objective, per token t of sequence i (sg = stop-gradient; every cfg name is a GRPOConfig field;
    logp, logp_prev, logp_gen, logp_ref = curr_, prev_, generation_, reference_logprobs; A = advantages):

        loss = REDUCE(w * pg) + beta * REDUCE(kl)

        pg   = max(-A * r, -A * clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max))    PPO, pessimistic side
               where A < 0 and ratio_clip_c = c is set:  pg = min(pg, -c * A)        dual clip
        r    = exp(logp - logp_prev)
               force_on_policy_ratio:  r = exp(logp - sg(logp)), no clip, logp_prev = sg(logp)
                                       (1 in value, the policy gradient in gradient)

        w    = sg(exp(logp_prev - logp_gen))   the tokens came from vLLM's policy, not from pi_prev
               truncated_importance_sampling_type (lo = ..._ratio_min, hi = ..._ratio):
                 tis           w = clamp(w, lo or 0, hi)
                 icepop        w = w * [lo <= w <= hi]                   a token out of bounds weighs 0
                 seq-mask-tis  w = w * [lo <= g_i <= hi],  g_i = exp(mean over i's tokens of
                               (logp_prev - logp_gen)): a sequence out of bounds weighs 0
                 None          w as is
               use_importance_sampling_correction false: w = 1

        kl   = Schulman's estimate of KL(pi || pi_ref) at each sampled token (a clamp set to None is skipped):
               u  = clamp(logp_ref - logp, -kl_input_clamp_value, kl_input_clamp_value)
               kl = clamp(exp(logp - sg(logp)) * K(u), -kl_output_clamp_value, kl_output_clamp_value)
               K: k1 = -u,  k2 = u^2 / 2,  k3 = exp(u) - 1 - u    (reference_policy_kl_type)
               exp(logp - sg(logp)) is 1 in value and adds the score-function gradient (tokens sampled
               from pi); where the input clamp bites there is no gradient. beta = reference_policy_kl_penalty.

        REDUCE(x), m = token_mask * sample_mask, over the GLOBAL batch's counts (so the micro-batch
        losses sum to the global batch's loss, however it is split):
            token_level_loss   sum_{i,t} m * x / (valid tokens + 1e-8)
            sequence level     sum_i sample_mask_i * x_i / (valid sequences + 1e-8),
                               x_i = sum_t token_mask * x / (sum_t token_mask + 1e-8)
    """
    mask = token_mask * sample_mask.unsqueeze(-1)
    toks, seqs = global_valid_toks, global_valid_seqs

    def token_mean(x):
        return masked_mean(x, mask, global_count=toks)

    def reduce_like_loss(x):
        # Token-level: every valid token weighs the same. Sequence-level: mean per
        # sequence first, then every valid sequence weighs the same.
        if cfg.token_level_loss:
            return token_mean(x)
        return masked_mean(masked_mean(x, token_mask, dim=-1), sample_mask, global_count=seqs)

    if cfg.force_on_policy_ratio:
        # One update per rollout: the previous policy *is* the current one.
        prev_logprobs = curr_logprobs.detach()

    # --- diagnostics of the generation vs training mismatch (no gradient) ---
    with torch.no_grad():
        kind = cfg.reference_policy_kl_type
        mult_prob_error = token_mean(torch.exp((generation_logprobs - prev_logprobs).abs() * mask))
        gen_kl = token_mean(kl_from_log_ratio(prev_logprobs - generation_logprobs, kind))
        policy_kl = token_mean(kl_from_log_ratio(generation_logprobs - prev_logprobs, kind))
        log_mix = torch.log(0.5 * prev_logprobs.exp() + 0.5 * generation_logprobs.exp())
        kl_prev_mix = torch.exp(prev_logprobs - log_mix) - (prev_logprobs - log_mix) - 1
        kl_gen_mix = torch.exp(generation_logprobs - log_mix) - (generation_logprobs - log_mix) - 1
        js_div = token_mean(0.5 * kl_prev_mix + 0.5 * kl_gen_mix)

    # --- KL penalty to the reference policy ---
    beta = cfg.reference_policy_kl_penalty
    if beta != 0:
        if reference_logprobs is None:
            raise ValueError("reference_policy_kl_penalty > 0 needs reference_logprobs")
        # exp(x - sg(x)) is 1 in value but adds the score-function gradient: the tokens
        # were sampled from the policy being optimised.
        weight = torch.exp(curr_logprobs - curr_logprobs.detach()).nan_to_num(0.0, 0.0, 0.0)
        lr = reference_logprobs - curr_logprobs
        if cfg.kl_input_clamp_value is not None:
            c = cfg.kl_input_clamp_value
            lr_clamped = lr.clamp(-c, c)
            # Where the input clamp bites, the weight's gradient goes too.
            weight = torch.where(lr == lr_clamped, weight, weight.detach())
            lr = lr_clamped
        kl = weight * kl_from_log_ratio(lr, kind)
        if cfg.kl_output_clamp_value is not None:
            kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
        kl = reduce_like_loss(beta * kl)
    else:
        kl = torch.zeros((), dtype=curr_logprobs.dtype)

    # --- PPO clipped objective: r = pi / pi_prev, pessimistic of clipped and unclipped ---
    if cfg.force_on_policy_ratio:
        ratio = torch.exp(curr_logprobs - curr_logprobs.detach())  # 1, with gradient 1
        ratio_clamped = ratio
    else:
        ratio = torch.exp(curr_logprobs - prev_logprobs)
        ratio_clamped = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio_clamped
    pg = torch.max(loss_unclipped, loss_clipped)
    if cfg.ratio_clip_c is not None:
        # Dual clip: with A < 0 a huge ratio could blow up the loss; cap it at |A| * c.
        dual = -advantages * cfg.ratio_clip_c
        dual_active = (advantages < 0) & (dual < pg)
        pg = torch.where(advantages < 0, torch.min(pg, dual), pg)

    # --- importance sampling: the tokens came from vLLM's policy, not from pi_prev ---
    w = torch.exp(prev_logprobs - generation_logprobs).detach().nan_to_num(0.0, 0.0, 0.0)
    is_metrics = {}
    if cfg.truncated_importance_sampling_type is not None:  # the config ensures the correction is on
        kind_is = cfg.truncated_importance_sampling_type
        lo, hi = cfg.truncated_importance_sampling_ratio_min, cfg.truncated_importance_sampling_ratio
        if kind_is == "tis":  # clamp the weights
            lo = 0.0 if lo is None else lo
            is_metrics["is_oob_ratio"] = token_mean(((w > hi) | (w < lo)).to(w.dtype)).item()
            w = w.clamp(lo, hi)
        elif kind_is == "icepop":  # drop tokens whose weight is out of bounds
            keep = (w >= lo) & (w <= hi)
            is_metrics["is_oob_ratio"] = token_mean((~keep).to(w.dtype)).item()
            w = torch.where(keep, w, torch.zeros_like(w))
        else:  # seq-mask-tis: drop whole sequences by geometric-mean weight
            log_w = (prev_logprobs - generation_logprobs).nan_to_num(0.0, 0.0, 0.0)
            geo_mean = masked_mean(log_w, token_mask, dim=-1).exp().detach()
            keep = ((geo_mean >= lo) & (geo_mean <= hi)).to(w.dtype)
            is_metrics["is_oob_ratio"] = masked_mean(1.0 - keep, sample_mask, global_count=seqs).item()
            w = w * keep.unsqueeze(-1)
    weight = w if cfg.use_importance_sampling_correction else torch.ones_like(w)

    actor_loss = reduce_like_loss(weight * pg)
    loss = actor_loss + kl

    with torch.no_grad():
        valid = mask.bool()
        r, rc = ratio.detach()[valid], ratio_clamped.detach()[valid]
        any_valid = r.numel() > 0
        entropy = -token_mean(torch.exp(curr_logprobs - generation_logprobs) * curr_logprobs)
        # Which side of the clip decided each token's loss (not in NeMo-RL's dict).
        clipped = loss_clipped > loss_unclipped
        clip_low = token_mean((clipped & (advantages < 0)).to(w.dtype)).item()
        clip_high = token_mean((clipped & (advantages > 0)).to(w.dtype)).item()
        dual_frac = token_mean(dual_active.to(w.dtype)).item() if cfg.ratio_clip_c is not None else 0.0
    metrics = {
        "loss": loss.item(),
        "probs_ratio": token_mean(ratio.detach()).item(),
        "probs_ratio_clamped": token_mean(ratio_clamped.detach()).item(),
        "probs_ratio_min": r.min().item() if any_valid else float("inf"),
        "probs_ratio_max": r.max().item() if any_valid else float("-inf"),
        "probs_ratio_clamped_min": rc.min().item() if any_valid else float("inf"),
        "probs_ratio_clamped_max": rc.max().item() if any_valid else float("-inf"),
        "kl_penalty": kl.item() / beta if beta != 0 else 0.0,
        "token_mult_prob_error": mult_prob_error.item(),
        "gen_kl_error": gen_kl.item(),
        "policy_kl_error": policy_kl.item(),
        "js_divergence_error": js_div.item(),
        "sampling_importance_ratio": token_mean(w).item(),
        "num_valid_samples": sample_mask.sum().item(),
        "approx_entropy": entropy.item(),
        **is_metrics,
        # NeMo-RL's VAPO term; not implemented here, kept so the dict matches.
        "positive_nll_loss": 0.0,
        "clip_fraction_low": clip_low,
        "clip_fraction_high": clip_high,
        "dual_clip_fraction": dual_frac,
    }
    return loss, metrics
