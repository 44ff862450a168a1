"""The extension's link flags: tools/build_config.json's, with -lstdc++ as the path of the shared libstdc++ that
torch runs with.

-lstdc++ alone links whatever the compiler's library search path finds first. The GPU image's /opt/gcc toolchain
has only libstdc++.a there, so the extension got a private static copy whose stream formatting broke inside
torch's process (on the H200, a segfault formatting the first error message; here, numbers lost from messages).
The libstdc++ mapped into this process once torch is imported is the one the extension must share.

    python tools/link_flags.py    # the flags as a CMake list (CMakeLists.txt)
"""

import json
import os

CONFIG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build_config.json")


def shared_libstdcxx(maps_path="/proc/self/maps"):
    """The path of the shared libstdc++ mapped into this process, or None (not Linux, or none mapped)."""
    try:
        with open(maps_path) as maps:
            paths = {fields[-1] for fields in (line.split() for line in maps) if len(fields) >= 6}
    except OSError:
        return None
    found = sorted(p for p in paths if os.path.basename(p).startswith("libstdc++.so") and os.path.isfile(p))
    return found[0] if found else None


def link_flags(config_flags=None, maps_path="/proc/self/maps"):
    """config_flags (default: build_config.json's link_flags) with -lstdc++ replaced by shared_libstdcxx()."""
    if config_flags is None:
        with open(CONFIG_PATH) as f:
            config_flags = json.load(f)["link_flags"]
    shared = shared_libstdcxx(maps_path)
    return [shared if (f == "-lstdc++" and shared) else f for f in config_flags]


if __name__ == "__main__":
    import torch  # noqa: F401  (maps torch's libstdc++ into this process)

    print(";".join(link_flags()))
