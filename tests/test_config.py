"""config.pbtxt through Triton's ModelConfig schema, derived from ONNX graphs."""

from __future__ import annotations

import onnx
import onnx_models as om
import pytest
from onnx import TensorProto, helper

from repo_manager.core import config as cfg
from repo_manager.core.errors import ConfigError, InputError
from repo_manager.ops.publish.onnx import load_onnx, onnx_config, signature


def test_dynamic_first_axis_gives_batching_and_dims_without_it(tmp_path):
    sig = signature(load_onnx(om.linear(tmp_path / "m.onnx", 4, 3)))
    config = onnx_config("lin", sig, cfg.ConfigOptions())
    assert config.max_batch_size == cfg.DEFAULT_MAX_BATCH
    assert [list(t.dims) for t in config.input] == [[4]]
    assert [list(t.dims) for t in config.output] == [[3]]
    assert config.backend == "onnxruntime"
    assert config.HasField("dynamic_batching")
    assert config.model_warmup[0].inputs["X"].dims == [4]


def test_static_first_axis_gives_no_batching_and_full_dims(tmp_path):
    sig = signature(load_onnx(om.static_fp16(tmp_path / "m.onnx")))
    config = onnx_config("s", sig, cfg.ConfigOptions())
    assert config.max_batch_size == 0
    assert list(config.input[0].dims) == [2, 3]
    assert cfg.dtype_name(config.input[0].data_type) == "FP16"
    assert not config.HasField("dynamic_batching")  # nothing to batch


def test_static_model_refuses_a_max_batch_size(tmp_path):
    sig = signature(load_onnx(om.static_fp16(tmp_path / "m.onnx")))
    with pytest.raises(InputError, match="no batch axis"):
        onnx_config("s", sig, cfg.ConfigOptions(max_batch_size=4))


def test_multi_io_types_and_variable_dims(tmp_path):
    config = onnx_config("m", signature(load_onnx(om.multi_io(tmp_path / "m.onnx"))), cfg.ConfigOptions())
    types = {t.name: cfg.dtype_name(t.data_type) for t in list(config.input) + list(config.output)}
    assert types == {"VALUES": "FP32", "IDS": "INT64", "PRODUCT_HALF": "FP16", "IDS_PLUS_ONE": "INT64",
                     "TOTAL": "FP32"}
    assert list(config.input[0].dims) == [-1]
    assert list(config.output[2].dims) == [1]


def test_options_set_batch_instances_and_warmup(tmp_path):
    sig = signature(load_onnx(om.linear(tmp_path / "m.onnx")))
    config = onnx_config("lin", sig, cfg.ConfigOptions(max_batch_size=32, instance_count=3,
                                                       dynamic_batching=False, warmup=False))
    assert config.max_batch_size == 32
    assert config.instance_group[0].count == 3
    assert not config.HasField("dynamic_batching")
    assert len(config.model_warmup) == 0
    config = onnx_config("lin", sig, cfg.ConfigOptions(max_batch_size=0))
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [-1, 4]


def test_generated_text_round_trips_through_the_schema(tmp_path):
    config = onnx_config("m", signature(load_onnx(om.multi_io(tmp_path / "m.onnx"))), cfg.ConfigOptions())
    path = tmp_path / "config.pbtxt"
    cfg.write_config(path, config)
    assert cfg.read_config(path) == config
    assert cfg.config_from_json(cfg.config_to_json(config)) == config


def test_malformed_config_is_a_config_error(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text('name: "x"\nmax_batch_size: "lots"\n')
    with pytest.raises(ConfigError, match="not a valid Triton model config"):
        cfg.read_config(path)


def test_sequence_outputs_are_refused_with_the_tensor_name(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("SequenceConstruct", ["X"], ["S"])], "seq",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", 2])],
        [helper.make_tensor_sequence_value_info("S", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "seq.onnx")
    with pytest.raises(InputError, match="output 'S' is a sequence_type"):
        signature(load_onnx(tmp_path / "seq.onnx"))


def test_scalar_inputs_are_refused(tmp_path):
    graph = helper.make_graph([helper.make_node("Neg", ["X"], ["Y"])], "scalar",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "scalar.onnx")
    with pytest.raises(InputError, match="scalar"):
        signature(load_onnx(tmp_path / "scalar.onnx"))


@pytest.mark.parametrize("spec, expected", [("TEXT:STRING:1", ("TEXT", "STRING", (1,))),
                                            ("X:fp32:-1,4", ("X", "FP32", (-1, 4)))])
def test_tensor_spec_parsing(spec, expected):
    parsed = cfg.TensorSpec.parse(spec)
    assert (parsed.name, parsed.dtype, parsed.dims) == expected


@pytest.mark.parametrize("spec", ["X", "X:FLOAT9:1", "X:FP32:a"])
def test_bad_tensor_specs_are_input_errors(spec):
    with pytest.raises(InputError):
        cfg.TensorSpec.parse(spec)


def test_written_config_is_readable_by_other_users(tmp_path):
    path = tmp_path / "config.pbtxt"
    cfg.write_config(path, cfg.ModelConfig(name="m", backend="python"))
    assert path.stat().st_mode & 0o044 == 0o044
