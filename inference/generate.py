"""``generate``: autoregressive decoding over any TP / PP / VPP layout, with a KV cache.

Every rank of the model-parallel group calls ``generate`` with the same arguments (a collective).

    prompts ─left-pad to s_p→ tokens (b, s_p), positions max(j − pad_b, 0)
    prefill:  one pipeline pass over (b, s_p) with an InferenceContext (KV cache filled)
    decode:   one pass per new token over (b, 1); position of sequence b = s_p + t − pad_b
    per pass: virtual stage v = 0 .. pp·vpp − 1 runs on pp rank v mod pp (chunk v div pp);
              the (s, b, h) activation goes to the next stage by send/recv (Megatron's order)
    last stage: logits (b, V/tp) of the last position ─all-gather over TP→ (b, V) ─padded ids
              → −inf─ greedy / sampled token (same on every TP rank) ─broadcast over the pipeline
              group→ every rank appends it

Sequence parallelism (a model loaded with ``sequence_parallel=True`` at tp > 1): the prompts are
left-padded to a multiple of tp so the prefill runs split over TP; a step whose token count tp
does not divide (a decode step's single token) runs with SP off (``sequence_parallel.py``).

``use_cache=False`` recomputes the whole sequence every step (the reference the KV cache is
checked against, and the benchmark's baseline): without padding through the training forward
itself, with padding through a fresh context per step (its document ids mask the pads).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.models.gpt import resolve_state
from tpfuse.parallel.mappings import gather_from_region

from .context import InferenceContext
from .sampling import SamplingParams, mask_padded_vocab, sample_next_tokens
from .sequence_parallel import StepContexts, prompt_length_multiple


def _unwrap(model) -> list:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return [getattr(chunk, "module", chunk) for chunk in chunks]


def check_prompts(prompt_ids, vocab_size: int) -> list[list[int]]:
    """Prompts as lists of ints; ValueError for an empty one or an id outside [0, vocab_size)."""
    if torch.is_tensor(prompt_ids):
        prompt_ids = prompt_ids.tolist() if prompt_ids.dim() == 2 else [prompt_ids.tolist()]
    elif prompt_ids and isinstance(prompt_ids[0], int):
        prompt_ids = [prompt_ids]
    prompts = [[int(t) for t in prompt] for prompt in prompt_ids]
    if not prompts or any(not prompt for prompt in prompts):
        raise ValueError("prompt_ids: every prompt needs at least one token")
    bad = [t for prompt in prompts for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids: ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return prompts


def _check_lengths(config, prompts, max_new_tokens: int) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    total = max(len(p) for p in prompts) + max_new_tokens
    learned = config.position_embedding_type == "learned_absolute"
    if learned and total > config.max_position_embeddings:
        raise ValueError(f"prompt length + max_new_tokens = {total} exceeds the model's "
                         f"max_position_embeddings={config.max_position_embeddings}")


def left_pad(prompts: list[list[int]], pad_id: int = 0, multiple: int = 1):
    """tokens (b, s_p) int64 left-padded with ``pad_id``, pad lengths (b,); s_p is the longest
    prompt's length rounded up to ``multiple``; on the host (the caller moves the tokens to the
    model's device)."""
    length = -(-max(len(p) for p in prompts) // multiple) * multiple
    pads = torch.tensor([length - len(p) for p in prompts], device="cpu")
    tokens = torch.tensor([[pad_id] * (length - len(p)) + p for p in prompts], device="cpu")
    return tokens, pads


def positions_for(pads: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """(b, count) positions of columns start .. start+count−1, counted from each first token."""
    columns = torch.arange(start, start + count, device=pads.device)
    return (columns[None, :] - pads[:, None]).clamp(min=0)


# ------------------------------------------------------------------ one pass through the stages
def pipeline_forward(chunks, tokens, position_ids, inference_context=None, state=None):
    """Run every virtual stage once; the last stage returns logits ``(b, s', V/tp)``, others None.

    ``tokens`` / ``position_ids`` ``(b, s)`` are given to every chunk (the first embeds them, all
    use the positions for rotary angles); activations ``(s, b, h)`` travel stage to stage.
    """
    chunks = _unwrap(chunks)
    pp = state.pp_size if state is not None else 1
    pp_rank = state.pp_rank if state is not None else 0
    stages = pp * len(chunks)
    config = chunks[0].config
    split = state.tp_size if state is not None and config.sequence_parallel else 1
    shape = (tokens.shape[1] // split, tokens.shape[0], config.hidden_size)   # (s[/tp], b, h)
    output, sends = None, []
    for stage in range(pp_rank, stages, pp):
        chunk = chunks[stage // pp]
        if stage > 0:
            received = torch.empty(shape, dtype=config.params_dtype, device=tokens.device)
            dist.recv(received, src=state.prev_pp_rank, group=state.pp_group)
            chunk.set_input_tensor(received)
        output = chunk(tokens, position_ids, inference_context=inference_context)
        if stage < stages - 1:
            sends.append(dist.isend(output.contiguous(), dst=state.next_pp_rank,
                                    group=state.pp_group))
    for work in sends:
        work.wait()
    return output if pp_rank == pp - 1 else None


def _choose(logits, vocab_size, params, generator, state):
    """(b,) next tokens on the last stage from its logits (b, s', V/tp) (TP-gathered first)."""
    last = logits[:, -1]                                                 # (b, V/tp)
    if state is not None and state.tp_size > 1:
        last = gather_from_region(last.contiguous(), state.tp_group)    # (b, V)
    return sample_next_tokens(mask_padded_vocab(last, vocab_size), params, generator)


def _share_from_last_stage(next_tokens, batch: int, device, state):
    """Every pipeline rank gets the last stage's (b,) tokens."""
    if state is None or state.pp_size == 1:
        return next_tokens
    if next_tokens is None:
        next_tokens = torch.empty(batch, dtype=torch.int64, device=device)
    dist.broadcast(next_tokens, src=state.ranks("pp")[-1], group=state.pp_group)
    return next_tokens


# ------------------------------------------------------------------ the decode loop
class _Decoder:
    """The loop's state: tokens so far, pads, cache (or None), and how to run one step."""

    def __init__(self, chunks, tokens, pads, max_new_tokens: int, use_cache: bool, state):
        self.chunks, self.tokens, self.pads, self.state = chunks, tokens, pads, state
        self.tp = state.tp_size if state is not None else 1
        self.padded = bool((pads > 0).any())
        self.step_context = StepContexts(chunks, self.tp)
        self.context = None
        if use_cache:
            self.context = InferenceContext(tokens.shape[0], tokens.shape[1] + max_new_tokens)
            if self.padded:
                self.context.set_left_padding(pads.to(tokens.device))

    def step_logits(self):
        """Logits of the newest position (b, 1|s, V/tp) on the last stage, None elsewhere."""
        length = self.tokens.shape[1]
        device = self.tokens.device
        if self.context is not None:                   # prefill, then one token at a time
            start = self.context.sequence_len_offset
            new = self.tokens[:, start:]
            positions = positions_for(self.pads, start, length - start).to(device)
            with self.step_context(length - start):
                logits = pipeline_forward(self.chunks, new, positions, self.context, self.state)
            self.context.increment_sequence_len_offset(length - start)
            return logits
        positions = positions_for(self.pads, 0, length).to(device)
        context = None
        if self.padded:                                # recompute, pads masked by a fresh context
            context = InferenceContext(self.tokens.shape[0], length)
            context.set_left_padding(self.pads.to(device))
        with self.step_context(length):
            return pipeline_forward(self.chunks, self.tokens, positions, context, self.state)


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens: int, *, greedy: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | None = None, seed: int = 1234, vocab_size: int | None = None,
             use_cache: bool = True, state=None) -> list[list[int]]:
    """New tokens for each prompt (up to and including ``eos_id``), the same on every rank.

    ``model``: this rank's GPTModel chunks (``load_model``'s result) or one GPTModel.
    ``prompt_ids``: a list of prompts (lists of ids, any lengths), one list, or a (b, s) tensor.
    Sampling: ``greedy`` (argmax) or temperature / top_k / top_p from a generator seeded with
    ``seed`` (identical on every rank). Ids ≥ ``vocab_size`` (default: the config's unpadded
    vocabulary) are never produced.
    """
    chunks = _unwrap(model)
    state = resolve_state(state)
    config = chunks[0].config
    vocab_size = vocab_size or config.vocab_size
    params = SamplingParams(greedy, temperature, top_k, top_p)
    prompts = check_prompts(prompt_ids, vocab_size)
    _check_lengths(config, prompts, max_new_tokens)
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id={eos_id} is outside the vocabulary [0, {vocab_size})")
    for chunk in chunks:
        chunk.eval()
    device = next(chunks[0].parameters()).device
    tp = state.tp_size if state is not None else 1
    tokens, pads = left_pad(prompts, multiple=prompt_length_multiple(chunks, tp) if use_cache
                            else 1)
    decoder = _Decoder(chunks, tokens.to(device), pads, max_new_tokens, use_cache, state)
    generator = torch.Generator(device=device).manual_seed(seed)
    results = [[] for _ in prompts]
    finished = torch.zeros(len(prompts), dtype=torch.bool, device="cpu")   # host bookkeeping
    for _ in range(max_new_tokens):
        logits = decoder.step_logits()
        chosen = None if logits is None else _choose(logits, vocab_size, params, generator, state)
        chosen = _share_from_last_stage(chosen, len(prompts), device, state)
        for i, token in enumerate(chosen.tolist()):
            if not finished[i]:
                results[i].append(token)
                finished[i] = token == eos_id
        if bool(finished.all()):
            break
        decoder.tokens = torch.cat([decoder.tokens, chosen[:, None]], dim=1)
    return results
