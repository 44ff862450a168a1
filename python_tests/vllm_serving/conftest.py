"""The vLLM tests need vLLM's CPU build, which lives in a venv of its own (``tools/vllm_env.sh``: it pins
transformers<5.20 and its own torch): CI runs them there as their own step (``bash tools/vllm_env.sh --test``).
Elsewhere (the main test venv) they are not collected; with ``SBD_EXT_REQUIRE_VLLM=1`` a missing vLLM is an error.
(The folder is not named ``vllm``: on ``sys.path`` that name would be a namespace package shadowing the question.)"""

import os

from sbd_ext.integration.vllm import vllm_installed

if not vllm_installed():
    if os.environ.get("SBD_EXT_REQUIRE_VLLM"):
        raise RuntimeError("SBD_EXT_REQUIRE_VLLM is set but vLLM is not installed: run tools/vllm_env.sh")
    collect_ignore_glob = ["test_*.py"]
