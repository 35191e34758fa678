"""The tests that run vLLM 0.33's own code: they need its sources (make vllm-env).

``make test`` runs them in a pytest of their own, with ``.vllm-env/site`` on
``PYTHONPATH`` and ``TIERING_REQUIRE_VLLM=1``: there, vLLM missing is a failure.
Anywhere else (a bare ``pytest``) they are skipped with the command that runs them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HOW = "make test-vllm (vLLM 0.33.0's sources in .vllm-env/site, on PYTHONPATH)"

if not HAVE_VLLM and os.environ.get("TIERING_REQUIRE_VLLM"):
    raise pytest.UsageError(f"TIERING_REQUIRE_VLLM is set but vLLM cannot be imported: run {HOW}")


if HAVE_VLLM:
    # vLLM and what it imports warn at import time about their own affairs (deprecated
    # torch.jit names, pydantic...): import them once here, with those warnings quiet.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _module in (
            "vllm.config",
            "vllm.v1.core.sched.scheduler",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
            "torch._inductor.compile_fx",
        ):
            importlib.import_module(_module)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if not str(item.path).startswith(here):
            continue
        if not HAVE_VLLM:
            item.add_marker(pytest.mark.skip(reason=f"needs vLLM's sources: {HOW}"))
        # vLLM and the packages it imports warn about their own affairs (deprecated
        # pydantic and torch names...); the project's own warnings stay errors.
        item.add_marker(pytest.mark.filterwarnings("default::DeprecationWarning"))
        item.add_marker(pytest.mark.filterwarnings("default::FutureWarning"))
        item.add_marker(pytest.mark.filterwarnings("default::UserWarning"))
        item.add_marker(pytest.mark.filterwarnings("default::PendingDeprecationWarning"))
