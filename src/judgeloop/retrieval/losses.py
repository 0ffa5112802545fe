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
    query_mask: torch.Tensor | None = None,
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
        mask: optional (B, N) bool, True where a candidate must be ignored (e.g. it is another
            positive of the query: a duplicate document in the batch is not a negative). Columns are
            the candidates ``[positives; negatives]``: this process's (N = B + B*k), or, when gathering,
            every process's in rank order (all positives of ranks 0..W-1, then all negatives).
            A query's own positive is never masked.
        query_mask: for the symmetric term, optional (B, B_q) bool, True where this process's
            positive i is also a positive of query j (queries of every process when gathering).
            Without gathering it defaults to ``mask[:, :B].T``; with gathering and a ``mask`` it is
            required.

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
        import torch.distributed as dist

        all_pos = gather_with_grad(pos_emb)
        if all_pos.shape[0] != b:
            offset = dist.get_rank() * b
        all_neg = gather_with_grad(neg_emb) if neg_emb is not None else None
    else:
        all_pos, all_neg = pos_emb, neg_emb
    docs = all_pos if all_neg is None else torch.cat([all_pos, all_neg], dim=0)  # (N, D)
    logits = query_emb @ docs.T / tau  # (B, N)
    labels = torch.arange(b, device=logits.device) + offset
    rows = torch.arange(b, device=logits.device)
    if mask is not None:
        if mask.shape != logits.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} must be (B, N) = {tuple(logits.shape)}")
        mask = mask.to(logits.device).clone()
        mask[rows, labels] = False  # the query's own positive stays the target
        logits = logits.masked_fill(mask, float("-inf"))
    loss = F.cross_entropy(logits, labels)
    if symmetric:
        all_q = gather_with_grad(query_emb) if gather_across_processes else query_emb
        logits_d = pos_emb @ all_q.T / tau  # (B, B_q): positive -> queries
        if query_mask is None and mask is not None:
            if gather_across_processes and all_pos.shape[0] != b:
                raise ValueError(
                    "symmetric=True with a mask across processes needs query_mask (B, B_global): which "
                    "gathered queries each local positive also answers"
                )
            query_mask = mask[:, :b].T  # doc i is another positive of query j -> skip query j for doc i
        if query_mask is not None:
            if query_mask.shape != logits_d.shape:
                raise ValueError(
                    f"query_mask shape {tuple(query_mask.shape)} must be (B, B_q) = {tuple(logits_d.shape)}"
                )
            query_mask = query_mask.to(logits_d.device).clone()
            query_mask[rows, labels] = False
            logits_d = logits_d.masked_fill(query_mask, float("-inf"))
        loss = 0.5 * (loss + F.cross_entropy(logits_d, labels))
    return loss
