import subprocess
import sys


def test_core_imports_without_torch():
    code = ("import sys, pagedserve.core.scheduler, pagedserve.core.kv_cache_manager, pagedserve.core.block_pool,"
            " pagedserve.core.kv_disk;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
