"""The architecture rule: softmax/scatter code lives in the attention core only."""
import re
from pathlib import Path

import gatlib

CORE = {"_core.py", "_backend.py", "_fused_cpu.py", "_triton.py"}
PATTERN = re.compile(r"scatter_reduce|index_add|(import|from) torch_scatter|segment_reduce|\bsoftmax\(|\.exp\(\)")


def test_no_softmax_or_scatter_outside_the_core():
    pkg = Path(gatlib.__file__).parent
    offenders = []
    for path in sorted(pkg.rglob("*.py")):
        if path.name in CORE:
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PATTERN.search(code):
                offenders.append(f"{path.name}:{no}: {line.strip()}")
    assert not offenders, "attention maths outside the core:\n" + "\n".join(offenders)
