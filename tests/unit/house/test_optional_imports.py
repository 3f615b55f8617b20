"""The project imports and runs its model and inference engine where the optional packages are absent (the
GPU machines' images lack megatron-core, torchao, zstandard and s3fs); using a feature that needs one fails
with a one-line error naming the package."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BLOCKED = ["megatron", "torchao", "zstandard", "s3fs", "transformer_engine", "wandb"]

# Every finder is wrapped so that the blocked top-level packages look uninstalled (find_spec returns None,
# import raises ModuleNotFoundError), as on a machine that never had them.
SCRIPT = textwrap.dedent('''
    import sys
    BLOCKED = set(sys.argv[1].split(","))

    class Hide:
        def __init__(self, finder):
            self.finder = finder
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                return None
            find = getattr(self.finder, "find_spec", None)
            return None if find is None else find(name, path, target)
        def __getattr__(self, attr):
            return getattr(self.finder, attr)

    sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
    assert not BLOCKED & set(sys.modules)

    import importlib, importlib.util, pkgutil
    from pathlib import Path
    root = Path.cwd()
    assert importlib.util.find_spec("zstandard") is None
    names = []
    for pkg in ("megatron_composer", "pretrain", "rl"):
        mod = importlib.import_module(pkg)
        names += [m.name for m in pkgutil.walk_packages(mod.__path__, pkg + ".")]
    for name in names:
        importlib.import_module(name)
    sys.path.insert(0, str(root / "tools"))
    scripts = sorted(p for p in (root / "tools").glob("*.py"))
    scripts += [root / "pretrain_composer.py", root / "rl_composer.py"]
    scripts += sorted((root / "benchmarks").glob("*.py"))
    for path in scripts:
        spec = importlib.util.spec_from_file_location("_probe_" + path.stem, path)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
        spec.loader.exec_module(module)
    print("imported", len(names), "modules and", len(scripts), "scripts")

    import torch
    from megatron_composer.model import Transformer, get_preset
    from megatron_composer.inference import Engine
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-deepseek-v3")).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    out = model(ids, mtp=True, return_routing=True)
    model(ids, routed_experts=out.routed_experts).sum().backward()
    res = Engine(model, max_batch_size=2, cache_memory_bytes=8 << 20).generate([ids[0].tolist()], max_new_tokens=4)
    assert len(res[0].token_ids) == 4

    from megatron_composer.optional import MissingDependency
    from rl.weight_sync.codec import encode_chunk, to_bits
    from rl.weight_sync.store import ObjectStore
    from megatron_composer.data.pretrain_data import check_indexed_dataset
    for what, call in (("zstandard", lambda: encode_chunk(to_bits(torch.zeros(4)), None, 3)),
                       ("s3fs", lambda: ObjectStore("s3://bucket/prefix")),
                       ("megatron-core", lambda: check_indexed_dataset("/nonexistent/x", 10, 0))):
        try:
            call()
        except MissingDependency as e:
            assert what in str(e) and "\\n" not in str(e), e
            print("error:", e)
        else:
            raise AssertionError(f"no MissingDependency for {what}")
''')


def test_project_imports_and_runs_without_optional_packages():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEGATRON_COMPOSER_CPP": "0", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(BLOCKED)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "imported" in r.stdout and r.stdout.count("error:") == 3, r.stdout
