"""LoRA adapters served by name, as vLLM serves them.

``specdec serve --enable-lora --lora-modules sql=/path/to/adapter`` serves the adapter under its
own name: a request whose ``model`` is ``sql`` runs through it, one that names the base model (or
none) through no adapter, and ``GET /v1/models`` lists each adapter beside the base model (its
``parent``). With ``--allow-runtime-lora-updating`` (or vLLM's environment variable
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), ``POST /v1/load_lora_adapter`` (``lora_name``,
``lora_path``) and ``POST /v1/unload_lora_adapter`` (``lora_name``) change them while serving,
and with ``--lora-resolver-dir DIR`` too (vLLM's ``VLLM_LORA_RESOLVER_CACHE_DIR``), a request
naming a model the server does not know loads the adapter in ``DIR/<model>`` and is served by it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from specdec.lora import LoRARequest
from specdec.serving.errors import APIError
from specdec.serving.strict import StrictModel

if TYPE_CHECKING:
    from specdec.llm import LLM
    from specdec.serving.app import ServerState

router = APIRouter()
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch, read by the CLI


def serve_adapters(llm: LLM, modules: list[LoRARequest], base_name: str) -> dict[str, LoRARequest]:
    """The adapters to serve, by name, each loaded once now so that a bad one fails at start
    with the engine's error (it may be let go later, and loaded again when asked for)."""
    if modules and llm.engine.loras is None:
        raise ValueError("lora_modules need an LLM with enable_lora=True (--enable-lora)")
    for module in modules:
        if module.name == base_name:
            raise ValueError(f"LoRA module {module.name!r} has the served model's name")
        llm.engine.add_lora(module)
    return {module.name: module for module in modules}


async def resolve_adapter(state: ServerState, model: str) -> bool:
    """Whether ``model`` names an adapter in the resolver directory (``--lora-resolver-dir``),
    now loaded and served under that name, as vLLM's filesystem resolver does; 400 for one
    that is there but cannot be loaded."""
    root = state.config.lora_resolver_dir
    if root is None or state.llm.engine.loras is None or model in ("", ".", ".."):
        return False
    path = Path(root) / model
    if path.parent != Path(root) or not (path / "adapter_config.json").is_file():
        return False  # not one directory's name under the root, or no adapter there
    async with state.resolving:
        if model not in state.loras:
            await _load(state, LoRARequest(model, next(state.lora_ids), str(path)), "model")
    return True


async def _load(state: ServerState, lora: LoRARequest, param: str) -> None:
    try:
        await state.engine.call(lambda engine: engine.add_lora(lora))
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e
    state.loras[lora.name] = lora


def adapter_of(state: ServerState, model: str | None) -> LoRARequest | None:
    """The adapter a request's ``model`` names (None: the base model)."""
    return None if model is None else state.loras.get(model)


def served_name(state: ServerState, model: str | None) -> str:
    """The name responses give as ``model``: the adapter's where one was asked for."""
    return model if model is not None and model in state.loras else state.model_name


class LoadAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str


class UnloadAdapterRequest(StrictModel):
    lora_name: str
    lora_int_id: int | None = None  # accepted as vLLM accepts it; the name decides


@router.post("/v1/load_lora_adapter")
async def load_adapter(body: LoadAdapterRequest, request: Request) -> PlainTextResponse:
    """Serve another adapter (vLLM's endpoint): loaded now, so that a bad one is refused here."""
    state: ServerState = request.app.state.server
    if body.lora_name in state.loras or body.lora_name == state.model_name:
        raise APIError(
            400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name"
        )
    try:
        lora = LoRARequest(body.lora_name, next(state.lora_ids), body.lora_path)
    except ValueError as e:
        raise APIError(400, str(e), param="lora_path") from e
    await _load(state, lora, "lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{lora.name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_adapter(body: UnloadAdapterRequest, request: Request) -> PlainTextResponse:
    """Stop serving an adapter (vLLM's endpoint). Requests running through it finish; its weights
    are let go now, or, while such requests run, when the engine next needs the room."""
    state: ServerState = request.app.state.server
    lora = state.loras.pop(body.lora_name, None)
    if lora is None:
        raise APIError(
            404,
            f"The lora adapter '{body.lora_name}' cannot be found.",
            param="lora_name",
            code="model_not_found",
        )

    def remove(engine):  # noqa: ANN001, ANN202
        with contextlib.suppress(ValueError):  # in use: let go later, as the least recently used
            engine.remove_lora(lora.adapter_id)

    await state.engine.call(remove)
    return PlainTextResponse(f"Success: LoRA adapter '{lora.name}' removed successfully.")
