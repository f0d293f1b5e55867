"""``use_beam_search`` (vLLM's extra field): beam search for a completion or a chat reply.

The search is :class:`specdec.beam_search.BeamSearcher`, transformers' rules as ``LLM.beam_search``
runs them; here each of its steps goes through the engine thread like any request (one
``max_tokens=1`` request per live beam, their logits gathered), so other requests keep running
between steps and a beam's prefix, its last partial block included, comes from the prefix cache.
``n`` is the width, and the ``n`` best hypotheses are the choices (best first). A request asks for
a search or for sampling, not both: the fields that shape sampling or the output's form are
refused with it (:func:`check_beam_request`). ``temperature`` ranks beams by the
log-probabilities of ``logits / temperature``, as vLLM's searches do (0 or 1: by the model's
own; unset: the generation config's temperature, else the model's own). A streamed search, as vLLM streams one, sends each choice whole once its prompt's
search has ended (a beam's text is not final until then).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import torch

from specdec.beam_search import MAX_BEAM_WIDTH, BeamSearcher, Search, step_params
from specdec.outputs import RequestOutput
from specdec.serving.adapters import adapter_of
from specdec.serving.bridge import EngineDeadError, GenerationRequest
from specdec.serving.errors import APIError
from specdec.serving.generation import Choice, Generation

if TYPE_CHECKING:
    from specdec.serving.app import ServerState
    from specdec.serving.protocol import GenerationFields

# what a beam-search request may set besides its prompt: the rest shapes sampling or the output
BEAM_FIELDS = {
    "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "use_beam_search",
    "length_penalty", "early_stopping", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "truncate_prompt_tokens", "seed", "user", "stream", "temperature", "priority",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
}  # fmt: skip


def check_beam_request(body: GenerationFields) -> None:
    """400 for what a beam search cannot honour: more than ``MAX_BEAM_WIDTH`` beams, or any
    field that shapes sampling or the output (logprobs, stop strings, penalties, guides, tools,
    ...)."""
    if (body.n or 1) > MAX_BEAM_WIDTH:
        message = f"n is the beam width with use_beam_search, at most {MAX_BEAM_WIDTH}"
        raise APIError(400, f"{message}; got {body.n}", param="n")
    fields = type(body).model_fields
    for name in sorted(body.model_fields_set - BEAM_FIELDS):
        if getattr(body, name) not in (None, False, fields[name].default):
            message = f"{name} is not supported with use_beam_search; leave it unset"
            raise APIError(400, message, param=name)


class BeamGeneration(Generation):
    """A beam search for each prompt, run step by step through the engine thread; its choices
    are each prompt's ``n`` best hypotheses (``finish_reason`` "stop" where one ended with an
    end-of-sequence token, else "length")."""

    def __init__(
        self,
        state: ServerState,
        body: GenerationFields,
        prompts: list[list[int]],
        max_tokens: list[int],  # per prompt, fitted to the context
        prompt_param: str,
    ):
        super().__init__(state, [], sum(len(p) for p in prompts), prompt_param)
        self.width = body.n or 1
        self.priority = body.priority
        self.lora = adapter_of(state, body.model)
        eos = () if body.ignore_eos else state.llm.engine.eos_token_ids
        temperature = body.temperature  # unset: the generation config's, as vLLM searches
        if temperature is None:
            temperature = state.llm.sampling_defaults.get("temperature", 0.0)
        self.searches = [
            Search(
                width=self.width,
                max_tokens=limit,
                eos=tuple(dict.fromkeys([*eos, *(body.stop_token_ids or [])])),
                length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
                early_stopping=bool(body.early_stopping)
                if body.early_stopping != "never"
                else "never",
                temperature=temperature,
            )
            for limit in max_tokens
        ]
        self.prompts = prompts
        self.skip_special_tokens = body.skip_special_tokens is not False
        self.choices = [Choice(prompt_token_ids=p) for p in prompts for _ in range(self.width)]
        self._in_flight: list[int] = []  # engine ids of the step being run

    async def start(self) -> bool:
        """Admit the request: room for ``n`` sequences, one per beam."""
        await self.state.gate.acquire(self.width, self.priority)
        self._admitted = True
        self.state.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        return True

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Search each prompt's beams in turn; once a prompt's search ends, fill its choices
        with the best and yield each whole, finished."""
        for p, (prompt, search) in enumerate(zip(self.prompts, self.searches)):
            searcher = BeamSearcher([prompt], search)
            while requests := searcher.requests():
                searcher.advance(await self._logits(requests))
            beams = searcher.result.completed[0]
            for rank, beam in enumerate(beams):
                i = p * self.width + rank
                choice = self.choices[i]
                body = beam.token_ids[:-1] if beam.finished else beam.token_ids  # no EOS text
                choice.text = await asyncio.to_thread(self._decode, body)
                choice.num_tokens = len(beam.token_ids)
                choice.finish_reason = "stop" if beam.finished else "length"
                yield (
                    i,
                    RequestOutput(
                        -1, prompt, list(beam.token_ids), choice.text, True, choice.finish_reason
                    ),
                )

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self.state.llm.tokenizer
        return str(tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens))

    async def _logits(self, requests: list[list[int]]) -> torch.Tensor:
        """The next-token logits of each token list, ``[n, V]``, from the engine thread."""
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        try:
            batch = [
                GenerationRequest(r, step_params(), 0, self.priority, self.lora) for r in requests
            ]
            self._in_flight = await self.state.engine.add(batch, outputs)
        except ValueError as e:  # the engine's checks on a prompt
            raise APIError(400, str(e), param=self.prompt_param) from e
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from e
        rows: dict[int, torch.Tensor] = {}
        while len(rows) < len(self._in_flight):
            item = await outputs.get()
            if isinstance(item, BaseException):
                raise APIError(503, f"Generation failed: {item}", "server_error") from item
            if item.finished and item.logits is not None:
                rows[item.request_id] = item.logits[-1:]
        ids, self._in_flight = self._in_flight, []
        return torch.cat([rows[i] for i in ids])

    def close(self) -> None:
        """Abort the step in flight and release the admission room (safe to call again)."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight:
            self.state.engine.abort(self._in_flight)
        if self._admitted:
            self.state.gate.release(self.width)
