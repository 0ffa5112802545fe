"""InfoNCE for bi-encoders: in-batch negatives plus mined hard negatives, optional symmetric term.

For query q_i with positive d_i^+ and the candidate set D (all positives and hard negatives in the
batch, gathered across processes when asked):

    L_i = -log( exp(s(q_i, d_i^+) / tau) / sum_{d in D} exp(s(q_i, d) / tau) )

(van den Oord et al. 2018, "Representation Learning with Contrastive Predictive Coding", eq. 4;
Karpukhin et al. 2020, DPR, eq. 2 for in-batch negatives). With ``symmetric=True`` the loss adds the
document-to-query direction over the batch's queries (CLIP, Radford et al. 2021) and averages the two.
``tau = 0.05`` equals sentence-transformers' ``MultipleNegativesRankingLoss(scale=20)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_with_grad(t: torch.Tensor) -> torch.Tensor:
    """Concatenate ``t`` from all processes along dim 0, keeping the autograd graph for the local slice.

    ``torch.distributed.nn.functional.all_gather`` sends each rank's gradient w.r.t. every slice back
    to the slice's owner (a reduce-scatter in backward), so the loss on rank r also trains the
    encoder on the documents other ranks contributed. Single process: returns ``t`` unchanged.
    Every process must pass the same shape (use equal per-process batch sizes, ``drop_last``).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(t.contiguous()), dim=0)


def info_nce_loss(
    query_emb: torch.Tensor,
    pos_emb: torch.Tensor,
    neg_emb: torch.Tensor | None = None,
    tau: float = 0.05,
    symmetric: bool = False,
    gather_across_processes: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """InfoNCE with in-batch and hard negatives.

    Args:
        query_emb: (B, D) query embeddings.
        pos_emb: (B, D) one positive per query; row i is the target of query i.
        neg_emb: (B * k, D) hard negatives (any order; every query sees all of them) or None.
        tau: temperature; scores are ``q . d / tau`` (use normalized embeddings for cosine).
        symmetric: also score each positive against all queries (doc -> query) and average.
        gather_across_processes: use the documents (and, for the symmetric term, queries) of every
            process as negatives; gradients flow back to the owning process.
        mask: optional (B, B + B*k) bool, True where a candidate must be ignored (e.g. it is another
            positive of the query: a duplicate document in the batch is not a negative). Columns are
            ``[positives; negatives]`` of this process only; when gathering, pass None.

    Returns:
        Scalar mean loss over this process's queries.
    """
    if tau <= 0:
        raise ValueError(f"tau={tau} must be > 0; sentence-transformers' scale=20 is tau=0.05")
    if query_emb.shape != pos_emb.shape:
        raise ValueError(f"query_emb {tuple(query_emb.shape)} and pos_emb {tuple(pos_emb.shape)} must match")
    b = query_emb.shape[0]
    offset = 0
    if gather_across_processes:
        if mask is not None:
            raise ValueError("mask is per-process; pass mask=None with gather_across_processes=True")
        import torch.distributed as dist

        all_pos = gather_with_grad(pos_emb)
        if all_pos.shape[0] != b:
            offset = dist.get_rank() * b
        all_neg = gather_with_grad(neg_emb) if neg_emb is not None else None
    else:
        all_pos, all_neg = pos_emb, neg_emb
    docs = all_pos if all_neg is None else torch.cat([all_pos, all_neg], dim=0)  # (N, D)
    logits = query_emb @ docs.T / tau  # (B, N)
    if mask is not None:
        if mask.shape != logits.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} must be (B, N) = {tuple(logits.shape)}")
        target_cols = torch.arange(b, device=logits.device)
        keep_target = torch.zeros_like(mask)
        keep_target[torch.arange(b), target_cols] = True
        logits = logits.masked_fill(mask & ~keep_target, float("-inf"))
    labels = torch.arange(b, device=logits.device) + offset
    loss = F.cross_entropy(logits, labels)
    if symmetric:
        all_q = gather_with_grad(query_emb) if gather_across_processes else query_emb
        logits_d = pos_emb @ all_q.T / tau  # (B, B_global): positive -> queries
        if mask is not None:
            qmask = mask[:, :b].T  # doc j is another positive of query i -> skip that query for doc j
            logits_d = logits_d.masked_fill(qmask & ~keep_target[:, :b], float("-inf"))
        loss = 0.5 * (loss + F.cross_entropy(logits_d, labels))
    return loss
