"""Rows packed into one forward pass: the training passes of the warm start and the RL learner.

A training batch is many short rows, most of them sharing a head (a group's prompt: the system prompt, the tools,
the task), each with a short tail of its own (the sampled turns). Run as a padded batch, a micro-batch of rows
costs one model call per shared head and one per set of tails, each over a few hundred tokens: the matrices are
small, the model's Python runs dozens of times a step, and bf16 on AMX cannot pay for its casts. Packed, every
token of a micro-batch - each head once, then each row's own tokens - is one position of a single sequence
``[1, N]`` that runs through the model's own modules once: every linear layer sees all ``N`` tokens in one matrix
product, the output head runs only at the positions whose next token is wanted.

Only attention has to know the rows. The model runs with this module's attention function (transformers'
``AttentionInterface``, registered under ``PACKED_ATTENTION``), which reads the ``Pack`` passed with the call: the
packed queries are gathered into attention rows (a head's own causal rows; a row's tail, whose keys are its head's
then its own), run through PyTorch's SDPA with a mask built from the tokens' positions, and scattered back. Every
row sees exactly what it would see alone: the values equal the padded batch's up to float rounding, and the
gradient reaches a shared head from every row that reads it (``tests/policy/test_packed.py``).

The architectures packing supports are those whose attention calls transformers' attention interface with rotary
positions from ``position_ids`` and no sliding window: Qwen3 (the tiny default policy), Qwen2, Llama (SmolLM2),
Mistral. Any other model keeps the padded path (``supports_packing``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

__all__ = [
    "PACKED_ATTENTION",
    "Pack",
    "pack_rows",
    "packed_logits",
    "packed_token_logprobs",
    "supports_packing",
]

#: the attention implementation a packed call runs under (registered with transformers on first use)
PACKED_ATTENTION = "lightning_sdk_packed"

#: model types whose decoder layers packing is checked against (tests/policy/test_packed.py runs qwen3 and llama)
_PACKABLE = frozenset({"qwen3", "qwen2", "llama", "mistral"})


def _config(model: Any) -> Any:
    """The model's config (a PEFT wrapper's base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


def supports_packing(model: Any) -> bool:
    """Whether ``model`` can run packed rows: a decoder of a type in ``_PACKABLE`` (a PEFT wrapper's base model's
    type) whose layers all attend in full (no sliding window)."""
    config = _config(model)
    kind = getattr(config, "model_type", None)
    if kind not in _PACKABLE:
        return False
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return False
    return not (kind == "mistral" and getattr(config, "sliding_window", None) is not None)


@dataclass
class _Bucket:
    """Attention rows of similar shape: ``query`` [R, Lq] and ``key`` [R, Lk] index packed tokens (padding slots
    point at token 0), ``mask`` [R, 1, Lq, Lk] says which keys each query sees."""

    query: torch.Tensor
    key: torch.Tensor
    mask: torch.Tensor


@dataclass
class Pack:
    """A micro-batch of rows as one sequence (``pack_rows``).

    ``input_ids``/``position_ids`` [1, N]: each head once, then each row's own tokens, with the positions they hold
    in their row. ``buckets``: the attention rows; ``query_index``/``key_index``: every bucket's ``query``/``key``
    flattened and concatenated (one gather each per layer); ``scatter`` [N]: where each packed token's attention
    output sits in the buckets' outputs, flattened and concatenated the same way. ``select`` [S]: the packed positions
    whose next token is wanted, in row-major order of ``rows``/``cols`` [S] (the row, and the column of the
    ``[R, W-1]`` outputs that ``token_logprobs`` returns) and ``targets`` [S] (the wanted tokens)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    buckets: list[_Bucket]
    query_index: torch.Tensor
    key_index: torch.Tensor
    scatter: torch.Tensor
    select: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    shape: tuple[int, int]

    @property
    def query_sizes(self) -> list[int]:
        return [b.query.numel() for b in self.buckets]

    @property
    def key_sizes(self) -> list[int]:
        return [b.key.numel() for b in self.buckets]

    @property
    def tokens(self) -> int:
        """Tokens through the model."""
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> Pack:
        if self.input_ids.device == device:
            return self
        return Pack(
            self.input_ids.to(device),
            self.position_ids.to(device),
            [_Bucket(b.query.to(device), b.key.to(device), b.mask.to(device)) for b in self.buckets],
            self.query_index.to(device),
            self.key_index.to(device),
            self.scatter.to(device),
            self.select.to(device),
            self.rows.to(device),
            self.cols.to(device),
            self.targets.to(device),
            self.shape,
        )


def pack_rows(
    input_ids: torch.Tensor,
    lengths: Sequence[int],
    parts: Sequence[tuple[Sequence[int], int]],
    wanted: torch.Tensor,
) -> Pack:
    """Pack rows of ``input_ids`` [R, W] (row i's tokens are its first ``lengths[i]``) into one sequence.

    ``parts``: (rows, prefix) covering every row once: rows that share their first ``prefix`` tokens (``prefix`` >= 1
    and at least two rows; the head goes in once) or rows that run whole (``prefix`` 0). ``wanted`` [R, W-1] (bool):
    the columns whose next token's log-prob is wanted (column ``c`` predicts ``input_ids[:, c + 1]``)."""
    n_rows, width = input_ids.shape
    if len(lengths) != n_rows or tuple(wanted.shape) != (n_rows, max(width - 1, 0)):
        raise ValueError("pack_rows: lengths and wanted must describe input_ids' rows")
    ids_cpu = input_ids.detach().cpu()
    chunks: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    # where each (row, column) sits in the pack: its part's head for the prefix's columns, else its own tokens
    where = torch.full((n_rows, width), -1, dtype=torch.long)
    causal: list[tuple[torch.Tensor, torch.Tensor]] = []  # (query, key) index rows: heads and whole rows
    tails: list[tuple[torch.Tensor, torch.Tensor]] = []  # (query, key) index rows of rows' tails: head keys first
    seen: set[int] = set()
    n = 0
    for rows, prefix in parts:
        rows = list(rows)
        if prefix > 0 and len(rows) < 2:
            prefix = 0
        for i in rows:
            if i in seen or not 0 <= i < n_rows:
                raise ValueError(f"pack_rows: row {i} is in two parts or out of range")
            seen.add(i)
            if not prefix < lengths[i] <= width:
                raise ValueError(f"pack_rows: row {i} has length {lengths[i]} (width {width}, prefix {prefix})")
        head: torch.Tensor | None = None
        if prefix > 0:
            chunks.append(ids_cpu[rows[0], :prefix])
            positions.append(torch.arange(prefix))
            head = torch.arange(n, n + prefix)
            causal.append((head, head))
            n += prefix
        for i in rows:
            own = int(lengths[i]) - prefix
            chunks.append(ids_cpu[i, prefix : lengths[i]])
            positions.append(torch.arange(prefix, prefix + own))
            mine = torch.arange(n, n + own)
            if head is None:
                causal.append((mine, mine))
                where[i, : lengths[i]] = mine
            else:
                tails.append((mine, torch.cat([head, mine])))
                where[i, :prefix] = head
                where[i, prefix : lengths[i]] = mine
            n += own
    if len(seen) != n_rows:
        raise ValueError("pack_rows: the parts do not cover every row")
    position_ids = torch.cat(positions)
    buckets, order = [], []
    offset = 0
    for group in (causal, tails):
        for bucket, flat in _buckets(group, position_ids):
            buckets.append(bucket)
            order.append(flat + offset)
            offset += bucket.query.numel()
    scatter = torch.empty(n, dtype=torch.long)
    query_index = torch.cat([b.query.reshape(-1) for b in buckets])
    slots = torch.cat(order)
    scatter[query_index[slots]] = slots
    rows_t, cols_t = torch.nonzero(wanted.detach().cpu(), as_tuple=True)
    select = where[rows_t, cols_t]
    if bool((cols_t + 1 >= torch.tensor(list(lengths), dtype=torch.long)[rows_t]).any()):
        raise ValueError("pack_rows: a wanted column lies past its row's end")
    targets = ids_cpu[rows_t, cols_t + 1]
    return Pack(
        torch.cat(chunks).unsqueeze(0),
        position_ids.unsqueeze(0),
        buckets,
        query_index,
        torch.cat([b.key.reshape(-1) for b in buckets]),
        scatter,
        select,
        rows_t,
        cols_t,
        targets,
        (n_rows, max(width - 1, 0)),
    )


def _buckets(
    group: Sequence[tuple[torch.Tensor, torch.Tensor]],
    position_ids: torch.Tensor,
) -> Iterator[tuple[_Bucket, torch.Tensor]]:
    """Attention rows of one kind, sorted by key length and cut where padding to the longest would waste more than
    a third: each bucket and the flat slots (into its ``query`` flattened) of its real queries, in row order."""
    if not group:
        return
    order = sorted(range(len(group)), key=lambda j: (len(group[j][1]), len(group[j][0])))
    start = 0
    while start < len(order):
        end = start + 1
        longest_q, longest_k = len(group[order[start]][0]), len(group[order[start]][1])
        real = longest_q * longest_k
        while end < len(order):
            q, k = len(group[order[end]][0]), len(group[order[end]][1])
            lq, lk = max(longest_q, q), max(longest_k, k)
            if (end - start + 1) * lq * lk > 1.5 * (real + q * k):
                break
            longest_q, longest_k, real = lq, lk, real + q * k
            end += 1
        members = [group[j] for j in order[start:end]]
        query = torch.zeros(len(members), longest_q, dtype=torch.long)
        key = torch.zeros(len(members), longest_k, dtype=torch.long)
        qpos = torch.full((len(members), longest_q), torch.iinfo(torch.long).max)
        kpos = torch.full((len(members), longest_k), torch.iinfo(torch.long).max)
        flat = []
        for r, (q_idx, k_idx) in enumerate(members):
            query[r, : len(q_idx)] = q_idx
            key[r, : len(k_idx)] = k_idx
            qpos[r, : len(q_idx)] = position_ids[q_idx]
            kpos[r, : len(k_idx)] = position_ids[k_idx]
            flat.append(torch.arange(len(q_idx)) + r * longest_q)
        # a key is seen by the queries at or after its position; a padding query sees every real key (no empty
        # softmax row), its output is never read
        mask = (kpos.unsqueeze(1) <= qpos.unsqueeze(2)).unsqueeze(1)
        yield _Bucket(query, key, mask), torch.cat(flat)
        start = end


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention of a packed call (``query`` [1, H, N, D], ``key``/``value`` [1, Hkv, N, D]): per bucket, the
    attention rows gathered from the packed tokens, SDPA under the bucket's mask, the outputs scattered back to
    [1, N, H, D]. A model runs under it only inside ``packed_logits``, whose call passes the pack to every layer
    (``attention_mask`` is its placeholder)."""
    pack: Pack | None = kwargs.pop("lightning_pack", None)
    if pack is None:
        raise ValueError("packed attention called without a pack (only packed_logits sets it on a model)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("packed rows: a sliding-window layer cannot run packed (supports_packing says no)")
    dtype = query.dtype
    # attention itself in fp32 whatever the autocast: on CPU, SDPA's bf16 backward was 4x its fp32 one on these
    # short rows (the matrix products around it are where bf16 pays)
    with torch.autocast(query.device.type, enabled=False):
        q, k, v = (t[0].transpose(0, 1).float() for t in (query, key, value))  # [N, heads, D]
        gqa = q.shape[1] != k.shape[1]
        # one gather per tensor for every bucket (one scatter-add each in the backward pass), then a view per bucket
        queries = torch.split(q[pack.query_index], pack.query_sizes)
        keys = torch.split(k[pack.key_index], pack.key_sizes)
        values = torch.split(v[pack.key_index], pack.key_sizes)
        outs = []
        for bucket, bq, bk, bv in zip(pack.buckets, queries, keys, values, strict=True):
            bq = bq.view(*bucket.query.shape, *bq.shape[1:]).transpose(1, 2)  # [R, H, Lq, D]
            bk = bk.view(*bucket.key.shape, *bk.shape[1:]).transpose(1, 2)
            bv = bv.view(*bucket.key.shape, *bv.shape[1:]).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                bq, bk, bv, attn_mask=bucket.mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
            outs.append(out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2]))
        return torch.cat(outs)[pack.scatter].unsqueeze(0).to(dtype), None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
        _registered = True


@contextlib.contextmanager
def _attention(config: Any, implementation: str) -> Iterator[None]:
    """``config``'s attention implementation set to ``implementation`` for the duration."""
    before = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = before


def _checkpointed(config: Any) -> Any:
    """A layer's ``_gradient_checkpointing_func``: PyTorch's non-reentrant checkpoint, which replays the call under
    the autocast it ran with; the replay, in the backward pass, runs under the packed attention again."""
    from torch.utils.checkpoint import checkpoint

    def call(function: Any, *args: Any) -> Any:
        def packed(*inner: Any) -> Any:
            with _attention(config, PACKED_ATTENTION):
                return function(*inner)

        return checkpoint(packed, *args, use_reentrant=False, preserve_rng_state=False)

    return call


@contextlib.contextmanager
def _packed_attention_on(model: Any, recompute: bool = False) -> Iterator[None]:
    """``model``'s attention set to ``PACKED_ATTENTION`` for the duration, and with ``recompute`` its decoder layers
    checkpointed (transformers' ``gradient_checkpointing`` flag on each layer that has one, in training mode); its
    own settings restored after."""
    _register()
    config = _config(model)
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")] if recompute else []
    saved = [(m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None)) for m in layers]
    for m in layers:
        m.gradient_checkpointing, m._gradient_checkpointing_func = True, _checkpointed(config)
    try:
        with _attention(config, PACKED_ATTENTION):
            yield
    finally:
        for m, (flag, func) in zip(layers, saved, strict=True):
            m.gradient_checkpointing = flag
            if func is None:
                del m._gradient_checkpointing_func
            else:
                m._gradient_checkpointing_func = func


def packed_logits(model: PreTrainedModel, pack: Pack, recompute: bool = False) -> torch.Tensor:
    """The logits [S, V] at ``pack.select`` (the positions whose next token is wanted) of one packed call; with
    ``recompute`` (and gradients on) each decoder layer keeps only its input for the backward pass and runs again
    there: ~one more forward pass for activations a layer's size instead of the whole model's."""
    device = next(model.parameters()).device
    pack = pack.to(device)
    with _packed_attention_on(model, recompute and torch.is_grad_enabled()):
        out = model(
            input_ids=pack.input_ids,
            position_ids=pack.position_ids,
            # a 4-D mask is taken as given (no mask is built); the packed attention reads the pack instead
            attention_mask=_NO_MASK,
            use_cache=False,
            logits_to_keep=pack.select,
            lightning_pack=pack,
        )
    return out.logits[0]  # type: ignore[no-any-return]


#: the placeholder 4-D mask a packed call passes (transformers builds none for a 4-D mask; the pack says it all)
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def packed_token_logprobs(
    model: PreTrainedModel, pack: Pack, temperature: float = 1.0, recompute: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs``' two [R, W-1] outputs (log-prob of each wanted token given its row's prefix, and the
    entropy of its predictive distribution) from one packed call: 0 at the columns that are not wanted."""
    logits = packed_logits(model, pack, recompute).float()
    if temperature > 0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = torch.gather(logp_all, -1, pack.targets.to(logits.device).unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    index = (pack.rows.to(logits.device), pack.cols.to(logits.device))
    out_logp = torch.zeros(pack.shape, device=logits.device, dtype=logp.dtype).index_put(index, logp)
    out_entropy = torch.zeros(pack.shape, device=logits.device, dtype=entropy.dtype).index_put(index, entropy)
    return out_logp, out_entropy
