"""Training losses that exported evaluation graphs carry: NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss."""

import torch

from .registry import register

_REDUCTIONS = ("none", "sum", "mean")
_SUMS = "a loss sums over the batch and the softmax exponentiates: beyond FP16's range"


def _check_reduction(node):
    r = node.attr("reduction", "mean")
    return None if r in _REDUCTIONS else f"{node.op_type} reduction '{r}' is not one of {', '.join(_REDUCTIONS)}"


def nll(node, log_probs, target, weight=None):
    """-log_probs[n, target[n, ...], ...] times the target class' weight; ignore_index positions count 0 and,
    for the mean, weigh nothing."""
    ignore = node.attr("ignore_index")
    target = target.long()
    keep = torch.ones_like(target, dtype=torch.bool) if ignore is None else target != ignore
    safe = torch.where(keep, target, 0).clamp(0, log_probs.shape[1] - 1)  # ignored positions may be out of range
    picked = -log_probs.gather(1, safe.unsqueeze(1)).squeeze(1)
    w = keep.to(log_probs.dtype) if weight is None else weight.to(log_probs.dtype)[safe] * keep
    loss = picked * w
    reduction = node.attr("reduction", "mean")
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / w.sum()
    return loss


@register("NegativeLogLikelihoodLoss", check=_check_reduction, keep_fp32=_SUMS, since=12)
def negative_log_likelihood_loss(node, x, target, weight=None):
    return nll(node, x, target, weight)


@register("SoftmaxCrossEntropyLoss", check=_check_reduction, keep_fp32=_SUMS, since=12)
def softmax_cross_entropy_loss(node, scores, labels, weight=None):
    log_probs = torch.log_softmax(scores, dim=1)
    return nll(node, log_probs, labels, weight), log_probs
