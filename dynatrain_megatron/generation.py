"""Greedy text generation with megatron-core's own inference code, on model chunks of any
layout without pipeline parallelism (e.g. the weights at a generation layout,
`ElasticJob.weights_to`).

It runs megatron-core's static engine in its legacy mode (`StaticInferenceEngine(...,
legacy=True)` over a `TextGenerationController`, a `GPTInferenceWrapper` and a
`StaticInferenceContext` KV cache), which runs on the CPU with gloo as on GPUs. Not the
dynamic engine (megatron-core's GPU default): it needs pinned memory and flash-attention
kernels. Pipeline parallelism is refused: megatron-core 0.16.1's inference sends
activations between stages only from CUDA tensors.

The legacy engine reseeds torch's global generator on every call; every RNG the job
trains with (Python, numpy, torch, CUDA, megatron's tracker) is restored afterwards, so
the next training step draws what it would have drawn without generating. From
megatron-core 0.19 on, the engine also leaves its process-wide inference flag set, which
makes the next training step fail; it is cleared afterwards too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .api_types import ApiError
from .loop.switching import RngSnapshot

log = logging.getLogger("dynatrain")


@dataclass(frozen=True, slots=True)
class GreedyGeneration:
    """What `generate_greedy` produced: per prompt, the prompt's token ids, the generated
    token ids and their text."""

    prompts: tuple[str, ...]
    prompt_tokens: tuple[tuple[int, ...], ...]
    tokens: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if not (len(self.prompt_tokens) == len(self.tokens) == len(self.texts) == n):
            raise ApiError(f"GreedyGeneration: {n} prompts but {len(self.prompt_tokens)} "
                           f"prompt token lists, {len(self.tokens)} token lists, "
                           f"{len(self.texts)} texts")


def byte_tokenizer() -> Any:
    """megatron-core's byte-level tokenizer (UTF-8 bytes are the ids 0-255; 0 is its end of
    document): a real tokenizer that needs no file. Generated ids >= 256 are dropped
    from the text, not from the tokens."""
    from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

    return MegatronTokenizerText(path="", config={"library": "byte-level"}, vocab_size=256)


def _bare(chunk: torch.nn.Module) -> torch.nn.Module:
    """The chunk without megatron's DDP wrapper (a Float16Module is kept: it casts)."""
    from megatron.core.distributed import DistributedDataParallel

    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


class _InferenceModeFlag:
    """megatron-core's process-wide "an inference engine is using the model" flag
    (`InferenceMode`, from 0.19 on; absent before), as it was when taken. The static engine
    sets it when built and never clears it; left set, the next training forward refuses to
    run (`GPTModel._postprocess`: "Inference must always gather TP logits")."""

    def __init__(self) -> None:
        try:
            from megatron.core.inference.utils import InferenceMode
        except ImportError:  # megatron-core 0.16: no such flag
            InferenceMode = None
        self._mode = InferenceMode
        self._was = InferenceMode.is_active() if InferenceMode is not None else False

    def restore(self) -> None:
        if self._mode is not None and not self._was:
            self._mode.unset_active()


def _static_controller(chunk: torch.nn.Module, config: Any, padded_vocab_size: int,
                       tokenizer: Any, pg_collection: Any, batch: int, max_length: int) -> Any:
    """megatron-core's TextGenerationController over a GPTInferenceWrapper with a
    StaticInferenceContext KV cache of `batch` x `max_length`, on `pg_collection`'s groups.
    Releases differ in how these are made, found by feature: megatron-core 0.16 takes an
    InferenceWrapperConfig and the groups as arguments; 0.19 (Megatron-LM core_v0.19.0)
    takes the sizes and reads the groups from the context's InferenceConfig."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import \
        GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import \
        TextGenerationController

    if hasattr(StaticInferenceContext, "from_config"):
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import \
            InferenceWrapperConfig

        wrapper_config = InferenceWrapperConfig(
            hidden_size=config.hidden_size, params_dtype=config.params_dtype,
            inference_batch_times_seqlen_threshold=-1, padded_vocab_size=padded_vocab_size,
            inference_max_requests=batch, inference_max_seq_length=max_length,
            fp32_residual_connection=config.fp32_residual_connection)
        context = StaticInferenceContext.from_config(wrapper_config)
        wrapped = GPTInferenceWrapper(chunk, wrapper_config, context, pg_collection=pg_collection)
        return TextGenerationController(wrapped, tokenizer, pp_group=pg_collection.pp)
    context = StaticInferenceContext(batch, max_length)
    context.config.pg_collection = pg_collection
    return TextGenerationController(GPTInferenceWrapper(chunk, context), tokenizer)


def generate_greedy(model: Sequence[torch.nn.Module], pg_collection: Any, tokenizer: Any,
                    prompts: Sequence[str], num_tokens: int) -> GreedyGeneration:
    """Generate `num_tokens` tokens per prompt greedily (top-1, no early stop), with a KV
    cache, every rank of the layout together (collective over its tensor-parallel group).
    `model`: the layout's model chunks (one: no pipeline parallelism), bare or in DDP;
    `pg_collection`: their process groups; `tokenizer`: megatron-core's (`tokenize`,
    `detokenize`, `eod`), e.g. `byte_tokenizer()`.

    Example::

        gen = job.weights_to("tp4pp1dp1")
        out = generate_greedy(gen.model, gen.pg_collection, byte_tokenizer(),
                              ["The quick brown fox"], num_tokens=8)
        job.weights_back()
    """
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.utils import get_model_config

    if len(model) != 1:
        raise ApiError(f"generation needs a layout without pipeline parallelism: got "
                       f"{len(model)} model chunks on this rank")
    if not prompts or num_tokens < 1:
        raise ApiError(f"generation needs prompts and num_tokens >= 1, got {len(prompts)} "
                       f"prompts and num_tokens={num_tokens}")
    if torch.distributed.get_world_size(pg_collection.pp) != 1:
        raise ApiError("generation needs a layout without pipeline parallelism (megatron-core's "
                       "inference sends activations between stages from CUDA tensors only)")
    chunk = _bare(model[0])
    config = get_model_config(chunk)
    inner = chunk
    while hasattr(inner, "module"):
        inner = inner.module
    prompt_tokens = [tuple(tokenizer.tokenize(p)) for p in prompts]
    max_length = max(map(len, prompt_tokens)) + num_tokens
    rng = RngSnapshot.take()
    was_training = chunk.training
    mode = _InferenceModeFlag()
    chunk.eval()
    try:
        controller = _static_controller(chunk, config, inner.vocab_size, tokenizer,
                                        pg_collection, len(prompts), max_length)
        engine = StaticInferenceEngine(controller, max_batch_size=len(prompts), legacy=True)
        params = SamplingParams(top_k=1, num_tokens_to_generate=num_tokens, termination_id=-1)
        with torch.no_grad():
            done = engine.generate(prompts=list(prompts), sampling_params=params)
    finally:
        chunk.train(was_training)
        mode.restore()
        rng.restore()
    tokens = tuple(tuple(int(t) for t in r.generated_tokens) for r in done)
    texts = tuple(str(r.generated_text) for r in done)
    return GreedyGeneration(tuple(prompts), tuple(prompt_tokens), tokens, texts)


__all__ = ["GreedyGeneration", "byte_tokenizer", "generate_greedy"]
