"""`trm publish model` against a real tritonserver: versions, verification, atomicity, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx_models as om
import onnxruntime as ort
import pytest

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError, VerificationError
from repo_manager.core.manifest import MANIFEST_NAME, read_manifest, sha256_file
from repo_manager.ops.publish import publish_model
from repo_manager.ops.serving import load_version


def _served_outputs(triton, repo_root, model, inputs, version=None):
    """Load the published version from the repository on the session server and infer."""
    repo = LocalRepository(repo_root)
    with TritonClient(triton.url) as client:
        # the session server's repository is a scratch folder: load via file overrides of the real files
        version = version or repo.latest(model)
        folder = repo.version_dir(model, version)
        config = cfg.parse_config(repo.manifest(model, version).config)
        files = {f"1/{p.relative_to(folder).as_posix()}": p.read_bytes()
                 for p in folder.rglob("*") if p.is_file()}
        name = f"served-{model}-{version}"
        config.name = name
        client.load(name, config, files)
        try:
            return client.infer(name, inputs)
        finally:
            client.unload(name)


@pytest.mark.parametrize("builder", [om.linear, om.multi_io, om.static_fp16])
def test_published_model_answers_like_onnxruntime(settings, triton, tmp_path, builder):
    source = builder(tmp_path / "src.onnx")
    result = publish_model(settings, source, "m")
    assert result.version == 1 and result.verified
    assert result.verification["samples"] >= 1
    config = LocalRepository(settings.repository).config("m")
    from repo_manager.adapters.loadgen.inputs import generate_inputs
    inputs = generate_inputs(config, batch_size=3 if config.max_batch_size else 1, variable_dim=6, seed=42)
    got = _served_outputs(triton, settings.repository, "m", inputs)
    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name].astype(np.float64), want[name].astype(np.float64), rtol=1e-3,
                                   atol=1e-3)


def test_versions_increase_and_each_has_a_complete_manifest(settings, tmp_path):
    sources = [om.linear(tmp_path / f"v{i}.onnx", seed=i) for i in range(3)]
    versions = [publish_model(settings, s, "lin").version for s in sources]
    assert versions == [1, 2, 3]
    repo = LocalRepository(settings.repository)
    assert repo.versions("lin") == [1, 2, 3]
    for version, source in zip(versions, sources):
        manifest = read_manifest(repo.version_dir("lin", version))
        assert manifest.version == version
        assert manifest.source["sha256"] == sha256_file(source)
        [entry] = manifest.files
        assert entry.path == "model.onnx" and entry.sha256 == sha256_file(source)
        assert manifest.verification["passed"] is True
        assert "onnxruntime" in manifest.environment
        cfg.parse_config(manifest.config)
    assert repo.validate() == []
    # config.pbtxt is the newest version's validated config
    assert (repo.model_dir("lin") / "config.pbtxt").read_text() == repo.manifest("lin", 3).config


def test_version_numbers_are_never_reused(settings, tmp_path):
    source = om.linear(tmp_path / "m.onnx")
    publish_model(settings, source, "lin", verify_model=False)
    publish_model(settings, source, "lin", verify_model=False)
    repo = LocalRepository(settings.repository)
    import shutil
    shutil.rmtree(repo.version_dir("lin", 2))
    assert publish_model(settings, source, "lin", verify_model=False).version == 2  # highest existing + 1
    (repo.model_dir("lin") / "7").mkdir()  # an incomplete folder still reserves its number
    assert publish_model(settings, source, "lin", verify_model=False).version == 8


def test_python_backend_folder_with_options(settings, tmp_path):
    folder = tmp_path / "pymodel"
    folder.mkdir()
    (folder / "model.py").write_text(
        "import numpy as np\nimport triton_python_backend_utils as pb\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        out = []\n"
        "        for r in requests:\n"
        "            x = pb.get_input_tensor_by_name(r, 'X').as_numpy()\n"
        "            out.append(pb.InferenceResponse([pb.Tensor('Y', (x * 2).astype(np.float32))]))\n"
        "        return out\n")
    (folder / "helper.txt").write_text("extra file shipped with the model\n")
    result = publish_model(settings, folder, "doubler", inputs=[cfg.TensorSpec.parse("X:FP32:3")],
                           outputs=[cfg.TensorSpec.parse("Y:FP32:3")])
    assert result.verified and result.files == 2
    config = LocalRepository(settings.repository).config("doubler")
    assert config.backend == "python" and config.max_batch_size == cfg.DEFAULT_MAX_BATCH


def test_python_model_with_wrong_output_type_fails_verification(settings, tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "model.py").write_text(
        "import numpy as np\nimport triton_python_backend_utils as pb\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [pb.InferenceResponse([pb.Tensor('Y', np.zeros((len(pb.get_input_tensor_by_name(r, 'X')"
        ".as_numpy()), 5), np.float64))]) for r in requests]\n")
    with pytest.raises(VerificationError):
        publish_model(settings, folder, "bad", inputs=[cfg.TensorSpec.parse("X:FP32:3")],
                      outputs=[cfg.TensorSpec.parse("Y:FP32:3")])
    assert not (Path(settings.repository) / "bad").exists()  # nothing left behind


def test_python_folder_with_its_own_config(settings, tmp_path):
    folder = tmp_path / "withcfg"
    folder.mkdir()
    (folder / "model.py").write_text(
        "import triton_python_backend_utils as pb\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [pb.InferenceResponse([pb.Tensor('OUT', pb.get_input_tensor_by_name(r, 'IN')"
        ".as_numpy())]) for r in requests]\n")
    (folder / "config.pbtxt").write_text(
        'name: "whatever"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "IN" data_type: TYPE_INT32 dims: [2] }]\n'
        'output [{ name: "OUT" data_type: TYPE_INT32 dims: [2] }]\n')
    result = publish_model(settings, folder, "echo")
    assert result.verified
    config = LocalRepository(settings.repository).config("echo")
    assert config.name == "echo" and config.max_batch_size == 0


def test_model_whose_answers_differ_is_refused_and_removed(settings, tmp_path, monkeypatch):
    """A reference that disagrees (as a broken conversion would) fails verification with the worst diff."""
    import repo_manager.ops.publish.onnx as onnx_mod

    original = onnx_mod.onnx_reference

    def skewed(path):
        run = original(path)
        return lambda inputs: {k: v + 0.5 for k, v in run(inputs).items()}

    monkeypatch.setattr(onnx_mod, "onnx_reference", skewed)
    with pytest.raises(VerificationError, match="worst absolute difference 0.5"):
        publish_model(settings, om.linear(tmp_path / "m.onnx"), "lin")
    assert not (Path(settings.repository) / "lin").exists()


@pytest.mark.parametrize("make_source, message", [
    (lambda d: d / "missing.onnx", "does not exist"),
    (lambda d: (d / "not.onnx").write_text("hello, I am text") and d / "not.onnx", "not a readable ONNX"),
    (lambda d: d, "cannot tell what"),
])
def test_bad_sources_are_input_errors_and_write_nothing(settings, tmp_path, make_source, message):
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(InputError, match=message):
        publish_model(settings, make_source(src), "m")
    assert not Path(settings.repository).exists() or not any(Path(settings.repository).iterdir())


def test_truncated_onnx_is_refused(settings, tmp_path):
    source = om.linear(tmp_path / "m.onnx", in_features=64, out_features=64)
    data = source.read_bytes()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="ONNX"):
        publish_model(settings, truncated, "m")


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".hidden", "", "x" * 200])
def test_hostile_model_names_are_refused(settings, tmp_path, name):
    with pytest.raises(InputError, match="not allowed"):
        publish_model(settings, om.linear(tmp_path / "m.onnx"), name)


def test_publish_killed_at_any_moment_leaves_no_partial_version(tmp_path, triton):
    """SIGKILL a real `trm publish` at several moments; every version left is complete and valid."""
    repo_root = tmp_path / "repo"
    source = om.linear(tmp_path / "big.onnx", in_features=1024, out_features=2048)  # ~8 MB
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # delays counted from the moment staging began (start-up time varies with the machine's load)
    delays = [0.0, 0.05, 0.2, 0.5, 1.0, 1.5, 2.5]
    for delay in delays:
        proc = subprocess.Popen([sys.executable, "-m", "repo_manager", "publish", "model", str(source),
                                 "--name", "big", "--repo", str(repo_root), "--url", triton.url],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while (proc.poll() is None and time.monotonic() < deadline
               and not list(repo_root.glob(f"big/.trm-tmp-{proc.pid}-*"))):
            time.sleep(0.01)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    repo = LocalRepository(repo_root)
    model_dir = repo_root / "big"
    numeric = sorted(int(p.name) for p in model_dir.iterdir() if p.name.isdigit()) if model_dir.exists() else []
    assert numeric == repo.versions("big")  # every numeric folder has its manifest
    for version in numeric:
        assert (repo.version_dir("big", version) / MANIFEST_NAME).is_file()
    # What may remain is repairable by `trm validate --fix`: staging leftovers, and config.pbtxt when the
    # kill fell between the version's rename (the commit point) and the config's replacement.
    for problem in repo.validate():
        assert "staging" in problem.message or "config.pbtxt is missing" in problem.message, problem
    repo.clean_staging()
    repo.repair_config("big")
    assert repo.validate() == []
    # and the next publish still works and takes the next number
    from repo_manager.core.settings import Settings
    result = publish_model(Settings(repository=repo_root, triton_url=triton.url), source, "big")
    assert result.version == (numeric[-1] + 1 if numeric else 1)


def test_load_version_pins_exactly_the_published_version(settings, tmp_path):
    from repo_manager.adapters.triton.server import TritonServer

    publish_model(settings, om.linear(tmp_path / "a.onnx", seed=1), "lin")
    publish_model(settings, om.linear(tmp_path / "b.onnx", seed=2), "lin")
    repo = LocalRepository(settings.repository)
    with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
        assert load_version(client, repo, "lin") == 2
        assert client.loaded_versions("lin") == [2]
        load_version(client, repo, "lin", 1)
        assert client.loaded_versions("lin") == [1]


def test_a_version_committed_without_its_config_is_repaired(settings, tmp_path):
    """The state a kill between the rename and the config write leaves: found, listed, and healed."""
    source = om.linear(tmp_path / "m.onnx")
    publish_model(settings, source, "lin", verify_model=False)
    repo = LocalRepository(settings.repository)
    (repo.model_dir("lin") / "config.pbtxt").unlink()
    assert repo.models() == ["lin"]
    [problem] = repo.validate()
    assert "config.pbtxt is missing" in problem.message
    assert publish_model(settings, source, "lin", verify_model=False).version == 2
    assert repo.validate() == []


def test_bytecode_a_python_backend_writes_is_not_a_validation_problem(settings, tmp_path):
    """A Python backend writes __pycache__ next to model.py (its stub ignores PYTHONDONTWRITEBYTECODE) into a
    version that lacks trm's empty __pycache__ file (one written before trm wrote it): that is not content of
    the version, and validate must not report it."""
    from repo_manager.adapters.triton.server import TritonServer

    folder = tmp_path / "py"
    folder.mkdir()
    (folder / "helper_mod.py").write_text("VALUE = 3\n")
    (folder / "model.py").write_text(
        "import sys, os\nsys.path.insert(0, os.path.dirname(__file__))\nimport helper_mod\n"
        "import numpy as np\nimport triton_python_backend_utils as pb\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [pb.InferenceResponse([pb.Tensor('Y', pb.get_input_tensor_by_name(r, 'X').as_numpy()"
        " * helper_mod.VALUE)]) for r in requests]\n")
    publish_model(settings, folder, "py", inputs=[cfg.TensorSpec.parse("X:FP32:2")],
                  outputs=[cfg.TensorSpec.parse("Y:FP32:2")])
    repo = LocalRepository(settings.repository)
    (repo.version_dir("py", 1) / "__pycache__").unlink()
    with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
        load_version(client, repo, "py")
        assert client.infer("py", {"X": np.ones((1, 2), np.float32)})["Y"].tolist() == [[3.0, 3.0]]
    assert list(repo.version_dir("py", 1).rglob("__pycache__/*.pyc"))  # what the stub left
    assert repo.validate() == []


def test_a_python_models_version_folder_gets_no_bytecode_so_triton_loads_it_once(tmp_path):
    """A Python model's stub writes __pycache__ into its version folder while it loads, and Triton then takes
    the folder for changed: the next load of the same version starts the model again. A version trm writes
    holds an empty file of that name instead, outside the manifest, and a second load starts nothing."""
    import rollout_models

    from repo_manager.adapters.triton.server import TritonServer

    root = tmp_path / "repo"
    rollout_models.tagged(root, "tagged", 1)
    version = root / "tagged" / "1"
    blocker = version / "__pycache__"
    assert blocker.is_file() and blocker.stat().st_size == 0
    assert "__pycache__" not in {f.path for f in read_manifest(version).files}
    assert LocalRepository(root).validate() == []
    with TritonServer(root) as server, TritonClient(server.url) as client:
        client.load("tagged")
        client.load("tagged")
        starts = server.log_path.read_text().count("TRITONBACKEND_ModelInstanceInitialize: tagged_0_0")
    assert starts == 1 and blocker.is_file()  # no bytecode written, no second start
    blocker.unlink()  # what a version written before this change looks like: the stub writes its cache
    with TritonServer(root) as server, TritonClient(server.url) as client:
        client.load("tagged")
        client.load("tagged")
        starts = server.log_path.read_text().count("TRITONBACKEND_ModelInstanceInitialize: tagged_0_0")
    assert starts == 2 and (version / "__pycache__").is_dir()  # the reload the empty file prevents
