"""`trm adopt`: hand-made Triton repositories (several backends, an ensemble, broken configs, odd folders)
become trm versions without a byte of what they hold being changed; verified on the real tritonserver."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli
from onnx_models import linear
from store_helpers import finish, tree_digest, trm_process
from unreadable import hide, trm_unprivileged

from repo_manager.adapters.loadgen import BackgroundLoad, Workload
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core.errors import InputError, IntegrityError
from repo_manager.core.manifest import (
    MANIFEST_NAME,
    MAX_CONFIG_BYTES,
    MAX_DATA_BYTES,
    MAX_LABEL_BYTES,
    FileEntry,
    Manifest,
    encode_data,
    read_manifest,
    sha256_file,
    sha256_inside,
)
from repo_manager.ops.rollout.plan import served_versions
from repo_manager.ops.serving import load_version

DOUBLER = (
    "import numpy as np\nimport triton_python_backend_utils as pb\n"
    "class TritonPythonModel:\n"
    "    def execute(self, requests):\n"
    "        return [pb.InferenceResponse([pb.Tensor('Y', (pb.get_input_tensor_by_name(r, 'X').as_numpy() * 2)"
    ".astype(np.float32))]) for r in requests]\n")

ONNX_CONFIG = """# written by hand, the way Triton's docs lay it out
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 3 ] }} ]
instance_group [ {{ kind: KIND_GPU, count: 1 }} ]
dynamic_batching {{ }}
"""


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def good_models(root: Path) -> Path:
    """Models Triton serves as they are: ONNX (versions 1 and 3), Python, TensorRT, PyTorch, an ensemble."""
    _write(root / "text_onnx" / "config.pbtxt", ONNX_CONFIG.format(name="text_onnx"))
    linear(root / "text_onnx" / "1" / "model.onnx", seed=1)
    linear(root / "text_onnx" / "3" / "model.onnx", seed=3)
    _write(root / "doubler" / "config.pbtxt", 'backend: "python"\nmax_batch_size: 8\n'
           'input [ { name: "X", data_type: TYPE_FP32, dims: [ 3 ] } ]\n'
           'output [ { name: "Y", data_type: TYPE_FP32, dims: [ 3 ] } ]\n')
    _write(root / "doubler" / "1" / "model.py", DOUBLER)
    _write(root / "trt_model" / "config.pbtxt", 'name: "trt_model"\nplatform: "tensorrt_plan"\nmax_batch_size: 4\n'
           'input [ { name: "x", data_type: TYPE_FP16, dims: [ 8 ] } ]\n'
           'output [ { name: "y", data_type: TYPE_FP16, dims: [ 8 ] } ]\n')
    _write(root / "trt_model" / "1" / "model.plan", os.urandom(4096))
    _write(root / "torch_model" / "config.pbtxt", 'backend: "pytorch"\nmax_batch_size: 4\n'
           'input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
           'output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 2 ] } ]\n')
    _write(root / "torch_model" / "1" / "model.pt", os.urandom(2048))
    _write(root / "pipeline" / "config.pbtxt", """name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT", data_type: TYPE_FP32, dims: [ 3 ] } ]
ensemble_scheduling { step [
  { model_name: "text_onnx" model_version: -1
    input_map { key: "X" value: "INPUT" } output_map { key: "Y" value: "mid" } },
  { model_name: "doubler" model_version: 1 input_map { key: "X" value: "mid" } output_map { key: "Y" value: "OUTPUT" } }
] }
""")
    (root / "pipeline" / "1").mkdir()
    return root


PY_BACKEND_README_MODEL = (  # the shape of the python_backend README's example: initialize, execute, finalize
    "import json\nimport numpy as np\nimport triton_python_backend_utils as pb_utils\n\n\n"
    "class TritonPythonModel:\n"
    "    def initialize(self, args):\n"
    "        self.model_config = json.loads(args['model_config'])\n\n"
    "    def execute(self, requests):\n"
    "        responses = []\n"
    "        for request in requests:\n"
    "            in_0 = pb_utils.get_input_tensor_by_name(request, 'INPUT0')\n"
    "            out_0 = pb_utils.Tensor('OUTPUT0', (in_0.as_numpy() + 1).astype(np.float32))\n"
    "            responses.append(pb_utils.InferenceResponse(output_tensors=[out_0]))\n"
    "        return responses\n\n"
    "    def finalize(self):\n"
    "        pass\n")
UPPER = (
    "import numpy as np\nimport triton_python_backend_utils as pb_utils\n\n\n"
    "class TritonPythonModel:\n"
    "    def execute(self, requests):\n"
    "        responses = []\n"
    "        for request in requests:\n"
    "            text = pb_utils.get_input_tensor_by_name(request, 'TEXT').as_numpy()\n"
    "            upper = np.array([t.upper() for t in text.reshape(-1)], dtype=np.object_).reshape(text.shape)\n"
    "            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor('UPPER', upper)]))\n"
    "        return responses\n")
LABELS = "tench\ngoldfish\ngreat white shark\n"
WARM_SAMPLE = np.arange(1, 6, dtype=np.float32).tobytes()
"""py_warm's warm-up input (warmup/input0.raw): Triton sends it once at load; the model answers its sum."""
WARM = (
    "import numpy as np\nimport triton_python_backend_utils as pb_utils\n\n\n"
    "class TritonPythonModel:\n"
    "    def initialize(self, args):\n"
    "        self.first = None\n\n"
    "    def execute(self, requests):\n"
    "        responses = []\n"
    "        for request in requests:\n"
    "            x = pb_utils.get_input_tensor_by_name(request, 'INPUT0').as_numpy()\n"
    "            if self.first is None:  # the warm-up request Triton makes at load, from warmup/input0.raw\n"
    "                self.first = float(x.sum())\n"
    "            out = np.full(x.shape, self.first, np.float32)\n"
    "            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor('OUTPUT0', out)]))\n"
    "        return responses\n")


def _ensemble_over_policy(root: Path) -> Path:
    """An ensemble stepping into onnx_named at model_version -1: Triton resolves it within the member's
    version_policy (version 1), not to the newest folder (2)."""
    _write(root / "policy_pipeline" / "config.pbtxt", 'platform: "ensemble"\nmax_batch_size: 8\n'
           'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
           'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
           'ensemble_scheduling { step [ { model_name: "onnx_named" model_version: -1\n'
           '  input_map { key: "X" value: "IN" } output_map { key: "Y" value: "OUT" } } ] }\n')
    (root / "policy_pipeline" / "1").mkdir(parents=True)
    return root


def triton_docs_layout(root: Path, *, ensemble: bool = True) -> Path:
    """Models laid out the way Triton's model_repository.md, model_configuration.md and the python_backend
    README describe them: a label file beside config.pbtxt, `platform` or `backend` (or both), no `name`,
    `version_policy`, `default_model_filename`, a SavedModel directory, TYPE_STRING, no max_batch_size."""
    _write(root / "densenet_onnx" / "config.pbtxt", """name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size : 0
version_policy: { latest: { num_versions: 1 } }
input [
  {
    name: "X"
    data_type: TYPE_FP32
    dims: [ -1, 4 ]
  }
]
output [
  {
    name: "Y"
    data_type: TYPE_FP32
    dims: [ -1, 3 ]
    label_filename: "densenet_labels.txt"
  }
]
""")
    _write(root / "densenet_onnx" / "densenet_labels.txt", LABELS)
    linear(root / "densenet_onnx" / "1" / "model.onnx", seed=11)
    linear(root / "densenet_onnx" / "2" / "model.onnx", seed=12)
    _write(root / "onnx_named" / "config.pbtxt", 'backend: "onnxruntime"\ndefault_model_filename: "linear.onnx"\n'
           'max_batch_size: 8\nversion_policy: { specific: { versions: [ 1 ] } }\n'
           'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
           'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
           'instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]\n')
    linear(root / "onnx_named" / "1" / "linear.onnx", seed=13)
    linear(root / "onnx_named" / "2" / "linear.onnx", seed=14)  # on disk, not served: the policy lists 1
    if ensemble:
        _ensemble_over_policy(root)
    _write(root / "onnx_dir" / "config.pbtxt", 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
           'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
           'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n')
    linear(root / "onnx_dir" / "1" / "model.onnx" / "model.onnx")  # the directory form of an ONNX model
    _write(root / "py_nobatch" / "config.pbtxt", 'name: "py_nobatch"\nbackend: "python"\n'
           'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
           'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n')
    _write(root / "py_nobatch" / "1" / "model.py", PY_BACKEND_README_MODEL)
    _write(root / "py_string" / "config.pbtxt", 'name: "py_string"\nbackend: "python"\nmax_batch_size: 2\n'
           'input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
           'output [ { name: "UPPER" data_type: TYPE_STRING dims: [ 1 ] } ]\n')
    _write(root / "py_string" / "1" / "model.py", UPPER)
    # model_warmup with input_data_file: Triton reads <model>/warmup/<file> at every load, and fails without it
    _write(root / "py_warm" / "config.pbtxt", 'backend: "python"\n'
           'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
           'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
           'model_warmup [ { name: "sample" batch_size: 1 inputs { key: "INPUT0" value: { data_type: TYPE_FP32 '
           'dims: [ 5 ] input_data_file: "input0.raw" } } } ]\n')
    _write(root / "py_warm" / "warmup" / "input0.raw", WARM_SAMPLE)
    _write(root / "py_warm" / "1" / "model.py", WARM)
    _write(root / "trt_labels" / "config.pbtxt", 'platform: "tensorrt_plan"\nmax_batch_size: 8\n'
           'input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]\n'
           'output [ { name: "output" data_type: TYPE_FP32 dims: [ 3 ] label_filename: "labels/classes.txt" } ]\n')
    _write(root / "trt_labels" / "labels" / "classes.txt", LABELS)
    _write(root / "trt_labels" / "1" / "model.plan", os.urandom(1000))
    _write(root / "torch_platform" / "config.pbtxt", 'platform: "pytorch_libtorch"\nmax_batch_size: 8\n'
           'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
           'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]\n')
    _write(root / "torch_platform" / "1" / "model.pt", os.urandom(500))
    saved = root / "tf_saved" / "1" / "model.savedmodel"  # a SavedModel is a directory
    _write(root / "tf_saved" / "config.pbtxt", 'platform: "tensorflow_savedmodel"\nmax_batch_size: 8\n'
           'input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
           'output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n')
    _write(saved / "saved_model.pb", os.urandom(300))
    _write(saved / "variables" / "variables.index", os.urandom(30))
    _write(saved / "variables" / "variables.data-00000-of-00001", os.urandom(300))
    _write(root / "tf_graphdef" / "config.pbtxt", 'backend: "tensorflow"\nplatform: "tensorflow_graphdef"\n'
           'max_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
           'output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n')
    _write(root / "tf_graphdef" / "1" / "model.graphdef", os.urandom(300))
    return root


def hand_made(root: Path) -> Path:
    """The good models plus what real repositories also hold: broken and templated configs, a misnamed
    model, a version folder without its model file, odd version folders, stray files, lost+found."""
    good_models(root)
    _write(root / "broken_cfg" / "config.pbtxt", 'name: "broken_cfg"\nbackend: "python"\nmax_batch_size: eight\n')
    _write(root / "broken_cfg" / "1" / "model.py", DOUBLER)
    _write(root / "templ" / "config.pbtxt", 'name: "templ"\nbackend: "onnxruntime"\n'
           'default_model_filename: "${MODEL_FILE}"\n')
    linear(root / "templ" / "1" / "model.onnx")
    _write(root / "misnamed" / "config.pbtxt", ONNX_CONFIG.format(name="other_name"))
    linear(root / "misnamed" / "1" / "model.onnx")
    _write(root / "nofile" / "config.pbtxt", ONNX_CONFIG.format(name="nofile"))
    _write(root / "nofile" / "1" / "README.txt", "the model was never copied here\n")
    _write(root / "odd" / "config.pbtxt", ONNX_CONFIG.format(name="odd"))
    linear(root / "odd" / "2" / "model.onnx", seed=2)
    linear(root / "odd" / "01" / "model.onnx", seed=4)
    linear(root / "odd" / "v5" / "model.onnx", seed=5)
    _write(root / "odd" / "notes.md", "how we built this\n")
    (root / "lost+found").mkdir()
    return root


def _adopt(capsys, *args):
    return run_cli(capsys, "adopt", *args, "--json")


def test_dry_run_lists_every_refusal_with_file_and_line_and_writes_nothing(capsys, tmp_path):
    repo = hand_made(tmp_path / "repo")
    before = tree_digest(repo)
    result = _adopt(capsys, repo, "--dry-run")
    assert result.code == 3
    plan = result.json()
    problems = "\n".join(plan["problems"])
    assert f"{repo / 'broken_cfg' / 'config.pbtxt'}:3:" in problems  # the line of `max_batch_size: eight`
    assert f"{repo / 'templ' / 'config.pbtxt'}:3: template placeholder ${{MODEL_FILE}}" in problems
    assert "names the model 'other_name'" in problems
    assert "nofile/1:" in problems and "no model file model.onnx" in problems
    assert "'01' is not a canonical version number" in problems
    models = {m["model"]: m for m in plan["models"]}
    assert [v["action"] for v in models["text_onnx"]["versions"]] == ["adopt", "adopt"]
    assert models["trt_model"]["backend"] == "tensorrt" and models["pipeline"]["backend"] == "ensemble"
    assert models["pipeline"]["members"] == {"1": {"text_onnx": 3, "doubler": 1}}
    assert any("v5: ignored by Triton" in n for n in models["odd"]["notes"])
    assert any("notes.md: ignored by Triton" in n for n in models["odd"]["notes"])
    assert any(n.startswith("lost+found") for n in plan["notes"])
    assert tree_digest(repo) == before
    # without --dry-run, a refusal still writes nothing
    assert _adopt(capsys, repo, "--no-verify").code == 3
    assert tree_digest(repo) == before and not list(repo.rglob(MANIFEST_NAME))


def test_adopt_in_place_verifies_on_triton_and_only_adds_manifests(capsys, tmp_path, triton):
    repo = triton_docs_layout(hand_made(tmp_path / "repo"), ensemble=False)
    before = tree_digest(repo)
    result = _adopt(capsys, repo, "--skip-broken", "--url", triton.url)
    assert result.code == 0, result.err
    adopted = {(a["model"], a["version"]): a for a in result.json()["adopted"]}
    docs_layout = {("densenet_onnx", 1), ("densenet_onnx", 2), ("onnx_named", 1), ("onnx_named", 2),
                   ("onnx_dir", 1), ("py_nobatch", 1), ("py_warm", 1),
                   ("py_string", 1), ("trt_labels", 1), ("torch_platform", 1), ("tf_saved", 1), ("tf_graphdef", 1)}
    assert set(adopted) == {("text_onnx", 1), ("text_onnx", 3), ("doubler", 1), ("trt_model", 1),
                            ("torch_model", 1), ("pipeline", 1), ("odd", 2)} | docs_layout
    for model in ("densenet_onnx", "onnx_named", "py_nobatch", "py_string", "py_warm"):  # answered on Triton
        assert adopted[(model, 1)]["verified"], adopted[(model, 1)]  # (py_warm loads only with its warm-up file)
    assert read_manifest(repo / "densenet_onnx" / "2").labels == {"densenet_labels.txt": LABELS}
    assert read_manifest(repo / "py_warm" / "1").model_files == {"warmup/input0.raw": WARM_SAMPLE}
    assert "ONNX model directory" in read_manifest(repo / "onnx_dir" / "1").verification["reason"]
    after = tree_digest(repo)
    assert {k: v for k, v in after.items() if not k.endswith(MANIFEST_NAME)} == before  # nothing else touched
    assert len(after) - len(before) == len(adopted)
    onnx_manifest = read_manifest(repo / "text_onnx" / "3")
    assert onnx_manifest.verification["passed"] and onnx_manifest.verification["reference"] == "onnxruntime"
    assert onnx_manifest.source["kind"] == "adopted"
    assert onnx_manifest.config == (repo / "text_onnx" / "config.pbtxt").read_text()  # the author's text
    assert {f.path: f.sha256 for f in onnx_manifest.files} == {
        "model.onnx": sha256_file(repo / "text_onnx" / "3" / "model.onnx")}
    trt = read_manifest(repo / "trt_model" / "1").verification
    assert trt["passed"] is False and "tensorrt cannot run" in trt["reason"]
    pipeline = read_manifest(repo / "pipeline" / "1")
    assert pipeline.members == {"text_onnx": 3, "doubler": 1} and pipeline.verification["passed"]
    assert read_manifest(repo / "doubler" / "1").verification["passed"]
    (repo / "lost+found").rmdir()  # `trm list` on the adopted repository, leftovers aside
    listed = {m["model"]: m["versions"] for m in run_cli(capsys, "list", "--repo", repo, "--json").json()["models"]}
    assert listed["text_onnx"] == [1, 3] and listed["pipeline"] == [1]

    # adopting twice changes nothing
    manifests = {p: p.read_bytes() for p in repo.rglob(MANIFEST_NAME)}
    again = _adopt(capsys, repo, "--skip-broken", "--url", triton.url)
    assert again.code == 0 and again.json()["adopted"] == [] and again.json()["already_adopted"] == 19
    assert {p: p.read_bytes() for p in repo.rglob(MANIFEST_NAME)} == manifests
    _write(repo / "densenet_onnx" / "densenet_labels.txt", LABELS + "hammerhead\n")  # labels edited afterwards
    changed = _adopt(capsys, repo, "--dry-run")
    assert changed.code == 3
    assert any("densenet_onnx/1" in p and "other label or data files" in p for p in changed.json()["problems"])
    _write(repo / "py_warm" / "warmup" / "input0.raw", WARM_SAMPLE[::-1])  # and warm-up data
    changed = _adopt(capsys, repo, "--dry-run")
    assert any("py_warm/1" in p and "other label or data files" in p for p in changed.json()["problems"])


def test_a_model_that_does_not_answer_is_refused_and_nothing_is_written(capsys, tmp_path, triton):
    repo = good_models(tmp_path / "repo")
    _write(repo / "doubler" / "1" / "model.py", DOUBLER.replace("* 2)", "* 2)[:, :2]"))  # answers [batch, 2]
    _write(repo / "not_onnx" / "config.pbtxt", ONNX_CONFIG.format(name="not_onnx"))
    _write(repo / "not_onnx" / "1" / "model.onnx", os.urandom(512))  # onnxruntime refuses it: exit 5, not 1
    before = tree_digest(repo)
    result = _adopt(capsys, repo, "--url", triton.url)
    assert result.code == 5 and "doubler/1" in result.err and "2 version(s) did not answer" in result.err
    assert tree_digest(repo) == before


def test_triton_docs_layout_into_a_target_then_push_sync_and_serve(capsys, tmp_path, s3_location):
    """Adopted --into a trm repository, pushed to a folder store and to S3, synced into a node repository and
    served there by the real tritonserver: label files travel with the versions (Triton fails a load without
    them), strings and ensembles answer, and not a byte of the team's repository changes."""
    source = triton_docs_layout(good_models(tmp_path / "team-repo"))
    before = tree_digest(source)
    target = tmp_path / "trm-repo"
    result = _adopt(capsys, source, "--into", target, "--no-verify")
    assert result.code == 0, result.err
    assert len(result.json()["adopted"]) == 19
    assert tree_digest(source) == before and not list(source.rglob(MANIFEST_NAME))
    assert run_cli(capsys, "validate", target, "--json").json()["ok"]
    for model in ("text_onnx", "densenet_onnx", "onnx_named", "tf_saved"):  # the author's text, byte for byte
        assert (target / model / "config.pbtxt").read_bytes() == (source / model / "config.pbtxt").read_bytes()
    densenet = read_manifest(target / "densenet_onnx" / "1")
    assert densenet.labels == {"densenet_labels.txt": LABELS} and densenet.source["kind"] == "adopted"
    assert (target / "trt_labels" / "labels" / "classes.txt").read_text() == LABELS
    assert (target / "py_warm" / "warmup" / "input0.raw").read_bytes() == WARM_SAMPLE
    assert read_manifest(target / "policy_pipeline" / "1").members == {"onnx_named": 1}  # what Triton's -1 serves
    assert {f.path for f in read_manifest(target / "tf_saved" / "1").files} == {
        "model.savedmodel/saved_model.pb", "model.savedmodel/variables/variables.index",
        "model.savedmodel/variables/variables.data-00000-of-00001"}
    shown = run_cli(capsys, "show", "onnx_named", "--repo", target, "--json")
    assert shown.code == 0 and shown.json()["versions"] == [1, 2]
    # into the same target again: identical versions are left alone
    assert _adopt(capsys, source, "--into", target, "--no-verify").json()["already_adopted"] == 19
    # a different version 1 already in the target is refused by name
    linear(source / "text_onnx" / "1" / "model.onnx", seed=99)
    clash = _adopt(capsys, source, "--into", target, "--dry-run")
    assert clash.code == 3 and "already holds a different version 1 of text_onnx" in "\n".join(clash.json()["problems"])
    # what was adopted moves through a store like anything trm published: a folder store and S3
    assert run_cli(capsys, "push", tmp_path / "store", "--repo", target, "--env", "prod").code == 0
    assert run_cli(capsys, "push", s3_location, "--repo", target, "--env", "prod").code == 0
    node = tmp_path / "node"
    synced = run_cli(capsys, "sync", s3_location, "--env", "prod", "--repo", node, "--cache", tmp_path / "cache")
    assert synced.code == 0, synced.err
    onnx_file = Path("text_onnx") / "3" / "model.onnx"
    assert sha256_file(node / onnx_file) == sha256_file(target / onnx_file)
    assert (node / "densenet_onnx" / "densenet_labels.txt").read_text() == LABELS
    assert (node / "py_warm" / "warmup" / "input0.raw").read_bytes() == WARM_SAMPLE
    assert run_cli(capsys, "validate", node, "--json").json()["ok"]
    # a plain layout for a stock Triton carries them too, beside config.pbtxt
    assert run_cli(capsys, "export", s3_location, tmp_path / "plain", "--env", "prod").code == 0
    assert (tmp_path / "plain" / "densenet_onnx" / "densenet_labels.txt").read_text() == LABELS
    assert (tmp_path / "plain" / "py_warm" / "warmup" / "input0.raw").read_bytes() == WARM_SAMPLE
    (node / "densenet_onnx" / "densenet_labels.txt").unlink()  # Triton would fail the load: validate says so
    (node / "py_warm" / "warmup" / "input0.raw").write_bytes(b"")
    assert not run_cli(capsys, "validate", node, "--json").json()["ok"]
    assert run_cli(capsys, "validate", node, "--fix", "--json").json()["ok"]
    assert (node / "densenet_onnx" / "densenet_labels.txt").read_text() == LABELS
    assert (node / "py_warm" / "warmup" / "input0.raw").read_bytes() == WARM_SAMPLE
    again = run_cli(capsys, "sync", s3_location, "--env", "prod", "--repo", node, "--cache", tmp_path / "cache",
                    "--json")
    assert again.code == 0 and again.json()["installed"] == [] and again.json()["configs_replaced"] == []
    (node / "py_warm" / "warmup" / "input0.raw").unlink()  # the quick path notices a model-folder file gone
    again = run_cli(capsys, "sync", s3_location, "--env", "prod", "--repo", node, "--cache", tmp_path / "cache",
                    "--json")
    assert again.code == 0 and again.json()["configs_replaced"] == ["py_warm"], again.out
    assert (node / "py_warm" / "warmup" / "input0.raw").read_bytes() == WARM_SAMPLE
    # served from the node: the classification Triton answers with the labels it read from the label file
    import tritonclient.http as httpclient

    server = TritonServer(node).start()
    try:
        with TritonClient(server.url) as client:
            for model in ("densenet_onnx", "py_string", "py_nobatch", "py_warm"):  # (text_onnx asks for a GPU)
                load_version(client, LocalRepository(node), model)
            # Triton warmed py_warm up with the synced file: its first request was 1+2+3+4+5
            assert client.infer("py_warm", {"INPUT0": np.zeros(3, np.float32)})["OUTPUT0"].tolist() == [15.0] * 3
            words = client.infer("py_string", {"TEXT": np.array([[b"triton"]], dtype=np.object_)})["UPPER"]
            assert words.reshape(-1).tolist() == [b"TRITON"]
            assert client.infer("py_nobatch", {"INPUT0": np.zeros(5, np.float32)})["OUTPUT0"].tolist() == [1.0] * 5
        raw = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        request = httpclient.InferInput("X", [1, 4], "FP32")
        request.set_data_from_numpy(np.ones((1, 4), np.float32))
        answer = raw.infer("densenet_onnx", [request],
                           outputs=[httpclient.InferRequestedOutput("Y", class_count=3)]).as_numpy("Y")
        assert {item.decode().rsplit(":", 1)[1] for item in answer.reshape(-1)} == set(LABELS.splitlines())
    finally:
        server.stop()


def test_hostile_layouts_are_refused(capsys, tmp_path):
    repo = tmp_path / "repo"
    _write(repo / "linked" / "config.pbtxt", ONNX_CONFIG.format(name="linked"))
    (repo / "linked" / "1").mkdir(parents=True)
    outside = linear(tmp_path / "elsewhere" / "model.onnx")
    (repo / "linked" / "1" / "model.onnx").symlink_to(outside)
    _write(repo / "Base" / "config.pbtxt", 'backend: "python"\n')
    _write(repo / "Base" / "1" / "model.py", DOUBLER)
    _write(repo / "base" / "config.pbtxt", 'backend: "python"\n')
    _write(repo / "base" / "1" / "model.py", DOUBLER)
    _write(repo / "tampered" / "config.pbtxt", 'backend: "python"\n')
    _write(repo / "tampered" / "1" / "model.py", DOUBLER)
    assert _adopt(capsys, repo, "--skip-broken", "--no-verify", "--dry-run").code == 0
    (repo / "tampered" / "1" / MANIFEST_NAME).write_text(json.dumps({"schema": "trm.manifest/1", "model": "x"}))
    problems = "\n".join(_adopt(capsys, repo, "--dry-run").json()["problems"])
    assert "model.onnx is a symbolic link" in problems
    assert "'base' and 'Base'" in problems or "'Base' and 'base'" in problems
    assert "tampered/1" in problems
    assert _adopt(capsys, tmp_path / "missing", "--dry-run").code == 3
    assert _adopt(capsys, repo, "--into", repo / "inside", "--dry-run").code == 3


def test_hostile_models_are_refused_with_their_file_and_exit_3(capsys, tmp_path):
    """Whatever a model folder holds, adopt answers with a refusal naming the file (exit 3), never a crash."""
    repo = tmp_path / "repo"
    python = 'backend: "python"\n'
    labelled = python + 'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] label_filename: "%s" } ]\n'
    warm = python + ('model_warmup [ { name: "w" batch_size: 1 inputs { key: "X" '
                     'value: { data_type: TYPE_FP32 dims: [ 1 ] input_data_file: "%s" } } } ]')
    for name, config in {"empty": "", "garbage": os.urandom(3000), "nul": 'backend: "python"\x00\n',
                         "deep": python + "x { " * 3000, "latin1": 'backend: "python" # caf\xe9\n'.encode("latin-1"),
                         "label_missing": labelled % "labels.txt", "label_escapes": labelled % "../../etc/hostname",
                         "label_binary": labelled % "labels.txt", "label_in_version": labelled % "1/labels.txt",
                         "--help": python, "my model": python, "modèle": python, "real": python,
                         "env": python + 'parameters: { key: "EXECUTION_ENV_PATH", value: { string_value: '
                                         '"$$TRITON_MODEL_DIRECTORY/py310.tar.gz" } }',
                         "warm": warm % "raw", "warm_escapes": warm % "../../../etc/hostname",
                         "warm_link": warm % "raw", "warm_big": warm % "big",
                         }.items():
        _write(repo / name / "config.pbtxt", config)
        _write(repo / name / "1" / "model.py", DOUBLER)
    _write(repo / "label_binary" / "labels.txt", b"\xff\xfe" + os.urandom(64))
    _write(repo / "label_in_version" / "1" / "labels.txt", "a\n")
    (repo / "warm_link" / "warmup").mkdir()
    (repo / "warm_link" / "warmup" / "raw").symlink_to(tmp_path / "outside.raw")
    _write(tmp_path / "outside.raw", os.urandom(4))
    with open(_write(repo / "warm_big" / "warmup" / "big", b""), "r+b") as big:
        big.truncate(MAX_DATA_BYTES + 1)  # sparse: larger than a manifest carries
    (repo / "alias").symlink_to("real")  # Triton serves a linked model folder: refused, not skipped
    (repo / "real" / "2").symlink_to("1")  # and a linked version folder
    _write(repo / "fifo" / "1" / "model.py", DOUBLER)
    os.mkfifo(repo / "fifo" / "config.pbtxt")
    before = tree_digest(repo)
    result = _adopt(capsys, repo, "--no-verify")
    assert result.code == 3 and tree_digest(repo) == before
    plan = _adopt(capsys, repo, "--dry-run")
    assert plan.code == 3
    refused = {m["model"]: m.get("refused") or " ".join(v.get("reason", "") for v in m["versions"])
               for m in plan.json()["models"]}
    assert set(refused) == {"empty", "garbage", "nul", "deep", "latin1", "label_missing", "label_escapes",
                            "label_binary", "label_in_version", "--help", "my model", "modèle", "real", "warm", "env",
                            "alias", "fifo", "warm_escapes", "warm_link", "warm_big"}
    assert all(refused.values()), refused
    for name in ("empty", "garbage", "nul", "deep", "latin1", "label_missing", "warm", "fifo"):
        assert str(repo / name / "config.pbtxt") in refused[name], refused[name]
    assert f"{repo / 'deep' / 'config.pbtxt'}:2:" in refused["deep"]
    assert "does not exist (Triton fails to load the model)" in refused["label_missing"]
    assert "not UTF-8" in refused["label_binary"]
    assert "warmup/raw does not exist (Triton fails to load the model)" in refused["warm"]  # warm-up data: carried,
    assert "names a file outside warmup/" in refused["warm_escapes"]  # but only from the model's warmup/ folder,
    assert "is a symbolic link" in refused["warm_link"]  # never through a link,
    assert "larger than 8 MiB" in refused["warm_big"]  # and small
    assert "'EXECUTION_ENV_PATH' reads py310.tar.gz from the model folder" in refused["env"]
    assert "symbolic link" in refused["alias"] and "real/2: a symbolic link" in refused["real"]
    assert plan.json()["counts"]["refused"] == len(refused)
    # --skip-broken adopts what is left: version 1 of the model behind the links
    rest = _adopt(capsys, repo, "--no-verify", "--skip-broken")
    assert rest.code == 0 and [(a["model"], a["version"]) for a in rest.json()["adopted"]] == [("real", 1)]


def test_sigkill_during_adoption_never_leaves_a_partial_manifest(tmp_path):
    repo = tmp_path / "repo"
    for model in range(6):
        _write(repo / f"m{model}" / "config.pbtxt", 'backend: "python"\n')
        for version in range(1, 9):
            _write(repo / f"m{model}" / str(version) / "model.py", DOUBLER + f"# {model}.{version}\n" + "#" * 200_000)
    before = tree_digest(repo)
    for delay in (0.4, 0.7, 1.0, 1.3):
        process = trm_process("adopt", repo, "--no-verify", "--json")
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        for path in repo.rglob(MANIFEST_NAME):
            manifest = read_manifest(path.parent)  # complete and parseable, never half written
            assert {f.path for f in manifest.files} == {"model.py"}
        assert {k: v for k, v in tree_digest(repo).items() if not k.endswith(MANIFEST_NAME)
                and "/.trm-tmp-" not in f"/{k}"} == before
    code, data, err = finish(trm_process("adopt", repo, "--no-verify", "--json"))
    assert code == 0, err
    assert len(data["adopted"]) + data["already_adopted"] == 48
    assert run_cli_validate(repo)


def run_cli_validate(repo: Path) -> bool:
    code, data, _ = finish(trm_process("validate", repo, "--json"))
    return code == 0 and data["ok"]


def test_adopted_versions_roll_out_with_zero_failed_requests(capsys, tmp_path):
    """What a team adopted moves like anything trm published: `trm rollout` from version 1 to 2 under load,
    with the label file its output names (the rollout's pre-check loads the version with it)."""
    repo = tmp_path / "repo"
    config = ONNX_CONFIG.format(name="lin").replace("KIND_GPU", "KIND_CPU")
    _write(repo / "lin" / "config.pbtxt", config.replace("dims: [ 3 ] }", 'dims: [ 3 ] label_filename: "l.txt" }'))
    _write(repo / "lin" / "l.txt", LABELS)
    linear(repo / "lin" / "1" / "model.onnx", seed=1)
    linear(repo / "lin" / "2" / "model.onnx", seed=2)
    assert _adopt(capsys, repo, "--no-verify").code == 0
    server = TritonServer(repo).start()
    try:
        with TritonClient(server.url) as client:
            load_version(client, LocalRepository(repo), "lin", 1)
        workload = Workload(({"X": np.ones((1, 4), np.float32)},))
        with BackgroundLoad(server.url, "lin", clients=2, workload=workload) as load:
            load.wait_for(20)
            result = run_cli(capsys, "--json", "-q", "rollout", "lin", "--version", 2, "--url", server.url,
                             "--grpc-url", server.endpoints.grpc, "--repo", repo)
            load.wait_for(load.count() + 20)
        assert result.code == 0, result.err
        assert load.summary().failed == 0
        with TritonClient(server.url) as client:
            assert served_versions(client, ["lin"]) == {"lin": (2,)}
    finally:
        server.stop()


PY_LABELLED = ('backend: "python"\n'
               'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] label_filename: "%s" } ]\n')
PY_WARM = ('backend: "python"\nmodel_warmup [ { name: "w" batch_size: 1 inputs { key: "X" '
           'value: { data_type: TYPE_FP32 dims: [ 1 ] input_data_file: "%s" } } } ]\n')


def test_a_link_anywhere_on_the_way_to_a_label_or_warmup_file_is_refused_and_nothing_outside_is_read(capsys,
                                                                                                      tmp_path):
    """Every component of a label, warm-up or model file's path is checked, not only the last one:
    `labels/sub -> /elsewhere` and a linked warmup/ folder are refused, and the outside file's text reaches
    no manifest, even with --skip-broken."""
    secret = "SECRET-OUTSIDE-TEXT\n"
    _write(tmp_path / "outside" / "sub" / "l.txt", secret)
    _write(tmp_path / "outside" / "warm" / "x.raw", secret)
    repo = tmp_path / "repo"
    _write(repo / "lab" / "config.pbtxt", PY_LABELLED % "labels/sub/l.txt")
    (repo / "lab" / "labels").mkdir()
    (repo / "lab" / "labels" / "sub").symlink_to(tmp_path / "outside" / "sub")  # a folder on the way
    _write(repo / "warmdir" / "config.pbtxt", PY_WARM % "x.raw")
    (repo / "warmdir" / "warmup").symlink_to(tmp_path / "outside" / "warm")  # the folder Triton reads, linked
    _write(repo / "warmsub" / "config.pbtxt", PY_WARM % "sub/x.raw")
    (repo / "warmsub" / "warmup").mkdir(parents=True)
    (repo / "warmsub" / "warmup" / "sub").symlink_to(tmp_path / "outside" / "warm")
    _write(repo / "libdir" / "config.pbtxt", 'backend: "python"\n')
    (repo / "libdir" / "1").mkdir(parents=True)
    (repo / "libdir" / "1" / "lib").symlink_to(tmp_path / "outside")  # inside a version: model files too
    _write(repo / "ok" / "config.pbtxt", 'backend: "python"\n')
    for name in ("lab", "warmdir", "warmsub", "libdir", "ok"):
        _write(repo / name / "1" / "model.py", DOUBLER)
    plan = _adopt(capsys, repo, "--dry-run")
    assert plan.code == 3
    refused = {m["model"]: m.get("refused") or " ".join(v.get("reason", "") for v in m["versions"])
               for m in plan.json()["models"]}
    assert f"{repo / 'lab' / 'labels' / 'sub'} is a symbolic link" in refused["lab"], refused["lab"]
    assert f"{repo / 'warmdir' / 'warmup'} is a symbolic link" in refused["warmdir"], refused["warmdir"]
    assert f"{repo / 'warmsub' / 'warmup' / 'sub'} is a symbolic link" in refused["warmsub"], refused["warmsub"]
    assert f"{repo / 'libdir' / '1' / 'lib'} is a symbolic link" in refused["libdir"], refused["libdir"]
    assert refused["ok"] == ""
    result = _adopt(capsys, repo, "--skip-broken", "--no-verify")
    assert result.code == 0, result.err
    assert [(a["model"], a["version"]) for a in result.json()["adopted"]] == [("ok", 1)]
    for manifest in repo.rglob(MANIFEST_NAME):
        assert "SECRET" not in manifest.read_text()
    assert not list((repo / "lab").rglob(MANIFEST_NAME))


def test_validate_names_a_label_file_reached_through_a_linked_folder(capsys, tmp_path):
    """A label file a version carries, later reached through a folder swapped for a link (same bytes
    outside): Triton would read through the link, so validate reports it."""
    repo = tmp_path / "repo"
    _write(repo / "lab" / "config.pbtxt", PY_LABELLED % "labels/sub/l.txt")
    _write(repo / "lab" / "labels" / "sub" / "l.txt", "a\nb\n")
    _write(repo / "lab" / "1" / "model.py", DOUBLER)
    assert _adopt(capsys, repo, "--no-verify").code == 0
    assert run_cli(capsys, "validate", repo, "--json").json()["ok"]
    _write(tmp_path / "outside" / "l.txt", "a\nb\n")
    (repo / "lab" / "labels" / "sub" / "l.txt").unlink()
    (repo / "lab" / "labels" / "sub").rmdir()
    (repo / "lab" / "labels" / "sub").symlink_to(tmp_path / "outside")
    checked = run_cli(capsys, "validate", repo, "--json").json()
    assert not checked["ok"] and any("label or data file" in str(p) for p in checked["problems"]), checked


def test_unreadable_files_and_folders_in_a_repository_are_problems_naming_them_never_left_out(tmp_path):
    """No mock: trm runs where the kernel refuses the reads (tests/unreadable.py). A version whose
    subfolder or file cannot be read, a label file that cannot be read and a model folder that cannot be
    listed are each a refusal naming the path (exit 3, nothing written), in the dry run and the real run
    alike; --skip-broken adopts the rest and reports them. (os.walk and rglob pass over an unreadable folder
    in silence: the version was adopted without it.)"""
    repo = tmp_path / "repo"
    for name in ("partial", "locked", "labels", "closed", "ok"):
        _write(repo / name / "config.pbtxt", 'backend: "python"\n')
        _write(repo / name / "1" / "model.py", DOUBLER)
    _write(repo / "partial" / "1" / "lib" / "helper.py", "HELP = 1\n")
    _write(repo / "locked" / "1" / "weights.bin", os.urandom(64))
    _write(repo / "labels" / "config.pbtxt", PY_LABELLED % "l.txt")
    _write(repo / "labels" / "l.txt", LABELS)
    hidden = [repo / "partial" / "1" / "lib", repo / "locked" / "1" / "weights.bin", repo / "labels" / "l.txt",
              repo / "closed"]
    hide(*hidden)
    code, plan, err = trm_unprivileged("adopt", repo, "--dry-run", "--json")
    assert code == 3, err
    problems = "\n".join(plan["problems"])
    for path in hidden:
        assert f"{path} cannot be read (permission denied)" in problems, problems
    assert plan["counts"] == {"adopt": 1, "present": 0, "refused": 4}
    code, _, err = trm_unprivileged("adopt", repo, "--no-verify")
    assert code == 3 and "4 problem(s)" in err, err
    assert all(f"{path} cannot be read" in err for path in hidden), err  # every one, not only the first
    assert not (repo / "ok" / "1" / MANIFEST_NAME).exists()
    code, result, err = trm_unprivileged("adopt", repo, "--no-verify", "--skip-broken", "--json")
    assert code == 0, err
    assert [(a["model"], a["version"]) for a in result["adopted"]] == [("ok", 1)]
    assert len(result["refused"]) == 4
    assert not (repo / "partial" / "1" / MANIFEST_NAME).exists()
    for path in hidden:
        path.chmod(0o755)  # (so that pytest can clean tmp_path up)


def test_names_a_manifest_cannot_record_are_refused_alike_by_the_dry_run_and_the_real_run(capsys, tmp_path):
    """A backslash, DEL or bytes that are not UTF-8 in a file name: the dry run refuses the version (it
    said "adopt" and the real run exited 7), the real run refuses it with exit 3 writing nothing, and
    --skip-broken skips exactly those."""
    repo = tmp_path / "repo"
    odd = {"backslash": "a\\b.txt", "del": "x\x7f.bin", "latin1": os.fsdecode(b"caf\xe9.bin"),
           "nested": os.fsdecode(b"d\xff") + "/w.bin"}
    for name, file in {**odd, "ok": "w.bin"}.items():
        _write(repo / name / "config.pbtxt", 'backend: "python"\n')
        _write(repo / name / "1" / "model.py", DOUBLER)
        _write(repo / name / "1" / file, b"\x00" * 8)
    before = tree_digest(repo)
    plan = _adopt(capsys, repo, "--dry-run")
    assert plan.code == 3
    actions = {m["model"]: m["versions"][0]["action"] for m in plan.json()["models"]}
    assert actions == {**{name: "refused" for name in odd}, "ok": "adopt"}
    assert all("a name a manifest cannot record" in p for p in plan.json()["problems"]), plan.json()["problems"]
    result = _adopt(capsys, repo, "--no-verify")
    assert result.code == 3 and "4 problem(s)" in result.err, result.err
    assert tree_digest(repo) == before
    rest = _adopt(capsys, repo, "--no-verify", "--skip-broken")
    assert rest.code == 0, rest.err
    assert [(a["model"], a["version"]) for a in rest.json()["adopted"]] == [("ok", 1)]
    assert len(rest.json()["refused"]) == 4
    assert run_cli(capsys, "list", "--repo", repo, "--json").code == 0


def test_adopt_never_writes_a_manifest_trm_cannot_read_back(capsys, tmp_path):
    """A config larger than a manifest records, label files that JSON-escape past what a reader accepts, and
    label files larger than the reader's limit in all are refused by the plan (the dry run says so); the
    rest is adopted and `trm list` reads the repository (it exited 7 for the whole repository)."""
    repo = tmp_path / "repo"
    _write(repo / "big_config" / "config.pbtxt", 'backend: "python"\n' + ("# padding\n" * (MAX_CONFIG_BYTES // 10)))
    _write(repo / "escapes" / "config.pbtxt", PY_LABELLED % "l.txt")
    _write(repo / "escapes" / "l.txt", "\x01" * (6 * 2**20))  # 6 MiB of text, 36 MiB as JSON
    _write(repo / "two_labels" / "config.pbtxt", 'backend: "python"\noutput [ '
           '{ name: "A" data_type: TYPE_FP32 dims: [ 1 ] label_filename: "a.txt" }, '
           '{ name: "B" data_type: TYPE_FP32 dims: [ 1 ] label_filename: "b.txt" } ]\n')
    _write(repo / "two_labels" / "a.txt", "a\n" * (5 * 2**20))  # 10 MiB each: 20 MiB in all
    _write(repo / "two_labels" / "b.txt", "b\n" * (5 * 2**20))
    _write(repo / "ok" / "config.pbtxt", 'backend: "python"\n')
    for name in ("big_config", "escapes", "two_labels", "ok"):
        _write(repo / name / "1" / "model.py", DOUBLER)
    plan = _adopt(capsys, repo, "--dry-run")
    assert plan.code == 3
    refused = {m["model"]: m.get("refused", "") for m in plan.json()["models"]}
    assert "larger than 4 MiB, more than a manifest records" in refused["big_config"], refused
    assert "MiB in a manifest (as JSON)" in refused["escapes"], refused
    assert "label files are larger than 16 MiB in all" in refused["two_labels"], refused
    assert refused["ok"] == ""
    result = _adopt(capsys, repo, "--no-verify", "--skip-broken")
    assert result.code == 0, result.err
    assert [(a["model"], a["version"]) for a in result.json()["adopted"]] == [("ok", 1)]
    listed = run_cli(capsys, "list", "--repo", repo, "--json")
    assert listed.code == 0, listed.err


def test_the_manifest_writer_and_reader_agree_on_every_bound():
    """Whatever `writable_json` lets through, the reader accepts, up to every limit at once; what the
    reader would refuse, the writer refuses first (exit 3, before a byte is written)."""
    entry = FileEntry("model.py", 1, "0" * 64)
    biggest = Manifest("m", 1, (entry,), "#" * MAX_CONFIG_BYTES, labels={"l.txt": "a" * MAX_LABEL_BYTES},
                       data=encode_data({"warmup/x": b"\x00" * MAX_DATA_BYTES}))
    assert Manifest.from_json(biggest.writable_json()).config == biggest.config
    for too_much in (dataclasses.replace(biggest, config="#" * (MAX_CONFIG_BYTES + 1)),
                     dataclasses.replace(biggest, labels={"l.txt": "\x01" * (6 * 2**20)}),
                     dataclasses.replace(biggest, labels={"a": "a" * MAX_LABEL_BYTES, "b": "b"})):
        with pytest.raises(InputError):
            too_much.writable_json()
        with pytest.raises(IntegrityError):
            Manifest.from_json(too_much.to_json())


def test_a_planted_manifest_is_present_only_when_its_files_config_and_verification_agree(capsys, tmp_path):
    """A trm-manifest.json found in a hand-made repository is a claim: accepted as already adopted only
    when its files (sha256), its config (byte for byte) and its verification agree with what adopt would
    record; otherwise the version is refused, naming why (adopt never replaces a file)."""
    repo = tmp_path / "repo"
    _write(repo / "py" / "config.pbtxt", 'backend: "python"\nmax_batch_size: 8\n')
    for version in (1, 2, 3, 4, 5):
        _write(repo / "py" / str(version) / "model.py", DOUBLER + f"# {version}\n")
    _write(repo / "trt" / "config.pbtxt", 'platform: "tensorrt_plan"\nmax_batch_size: 4\n')
    _write(repo / "trt" / "1" / "model.plan", os.urandom(256))
    assert _adopt(capsys, repo, "--no-verify").code == 0
    genuine = read_manifest(repo / "py" / "1")
    config = (repo / "py" / "config.pbtxt").read_text()
    verified = {"passed": True, "server": "http://127.0.0.1:8000", "samples": 1, "outputs_checked": ["Y"]}

    def plant(version: int, **changes) -> None:
        digest, size = sha256_inside(repo / "py" / str(version), "model.py")
        files = (FileEntry("model.py", size, digest),)
        manifest = dataclasses.replace(genuine, version=version, files=files, **changes)
        (repo / "py" / str(version) / MANIFEST_NAME).unlink()
        (repo / "py" / str(version) / MANIFEST_NAME).write_bytes(manifest.to_json())

    plant(2, config=config.replace("8", "64"),  # another max_batch_size, said to be verified
          verification=verified)
    plant(3, verification={})
    source = {**genuine.source, "config_sha256": "0" * 64}
    plant(4, source=source, verification=verified)
    plant(5, verification={**genuine.verification, "passed": True})  # forged, without a report
    forged = read_manifest(repo / "trt" / "1")
    (repo / "trt" / "1" / MANIFEST_NAME).unlink()
    (repo / "trt" / "1" / MANIFEST_NAME).write_bytes(dataclasses.replace(forged, verification=verified).to_json())
    plan = _adopt(capsys, repo, "--dry-run")
    assert plan.code == 3
    versions = {(m["model"], v["version"]): v for m in plan.json()["models"] for v in m["versions"]}
    assert versions[("py", 1)]["action"] == "present"
    reasons = {key: v.get("reason", "") for key, v in versions.items()}
    assert "records another config than the model's config.pbtxt" in reasons[("py", 2)], reasons
    assert "records no verification result" in reasons[("py", 3)], reasons
    assert "its source record does not match its config" in reasons[("py", 4)], reasons
    assert "verified but holds no verification report" in reasons[("py", 5)], reasons
    assert "adopt cannot run backend tensorrt" in reasons[("trt", 1)], reasons
    assert all("remove it to adopt the version again" in reasons[key] for key in reasons if key != ("py", 1))
    # and a config edited after adoption is not "already adopted" either
    _write(repo / "py" / "config.pbtxt", config.replace("8", "16"))
    again = _adopt(capsys, repo, "--dry-run")
    assert "records another config" in {(m["model"], v["version"]): v.get("reason", "")
                                         for m in again.json()["models"] for v in m["versions"]}[("py", 1)]


def test_every_problem_is_listed_and_a_model_file_outside_a_version_folder_is_noted(capsys, tmp_path):
    """The real run names every problem (not only the first, leaving the rest to --dry-run), and a model
    file beside config.pbtxt, which Triton ignores, is a note in both runs."""
    repo = hand_made(tmp_path / "repo")
    linear(repo / "stray" / "model.onnx")  # the model file, but not in a version folder
    _write(repo / "stray" / "config.pbtxt", ONNX_CONFIG.format(name="stray"))
    plan = _adopt(capsys, repo, "--dry-run").json()
    assert len(plan["problems"]) == 5
    stray = {m["model"]: m for m in plan["models"]}["stray"]
    assert any(n.startswith("model.onnx: a model file outside any version folder: Triton ignores it")
               for n in stray["notes"]), stray["notes"]
    result = run_cli(capsys, "adopt", repo, "--no-verify")
    assert result.code == 3 and "5 problem(s)" in result.err
    for problem in plan["problems"]:
        assert problem in result.err, (problem, result.err)
    rest = run_cli(capsys, "adopt", repo, "--no-verify", "--skip-broken")
    assert rest.code == 0, rest.err
    assert "note: stray: model.onnx: a model file outside any version folder" in rest.out, rest.out


def test_older_versions_of_a_folder_trm_keeps_are_already_adopted_with_their_own_configs(capsys, tmp_path):
    """Once trm publishes or tunes into a model folder, config.pbtxt is its newest version's config and
    older versions record the configs they were published with: adopting again leaves them all present
    (only a hand-made or adopted folder must agree with config.pbtxt byte for byte)."""
    source = tmp_path / "src"
    _write(source / "model.py", DOUBLER)
    repo = tmp_path / "repo"
    for batch in (8, 16):
        published = run_cli(capsys, "publish", "model", source, "--name", "py", "--repo", repo, "--input",
                            "X:FP32:3", "--output", "Y:FP32:3", "--max-batch-size", batch, "--no-verify")
        assert published.code == 0, published.err
    assert read_manifest(repo / "py" / "1").config != read_manifest(repo / "py" / "2").config
    plan = _adopt(capsys, repo, "--dry-run")
    assert plan.code == 0, plan.out
    assert plan.json()["counts"] == {"adopt": 0, "present": 2, "refused": 0}
