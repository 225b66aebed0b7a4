"""A checked checkpoint loaded in PyTorch (tokenizer, encoder with the head it declares), run on example
texts and exported to ONNX with that head inside the graph."""

from __future__ import annotations

import copy
import importlib
import inspect
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from repo_manager.core.errors import InputError
from repo_manager.ops.publish.huggingface import OUTPUTS
from repo_manager.ops.publish.huggingface.checkpoint import Checkpoint
from repo_manager.ops.publish.huggingface.pipeline import Pipeline
from repo_manager.ops.publish.huggingface.reference import quiet_transformers

OPSET = 17
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
QUERY = "what is the man eating?"
"""The query a reranker's example texts and verification cases are paired with."""


class LoadedCheckpoint:
    """The checkpoint in PyTorch: tokenizer, encoder with its head, and the tensor names it takes."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        try:
            import torch  # noqa: PLC0415 - the [torch] extra, only for this format
            import transformers  # noqa: PLC0415 - heavy library, imported where used
        except ImportError as exc:
            raise InputError(f"publishing a Hugging Face checkpoint needs torch and transformers ({exc.name} is "
                             "missing)", hint="pip install 'trm[torch]'") from exc
        self.checkpoint = checkpoint
        self.pipeline = checkpoint.pipeline
        self.torch = torch
        path = str(checkpoint.model_path)
        with quiet_transformers():
            self._load(transformers, path)

    def _load(self, transformers, path: str) -> None:
        checkpoint = self.checkpoint
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        except Exception as exc:
            raise self.refused("load", f"the tokenizer does not load: {first_line(exc)}") from exc
        if getattr(self.tokenizer, "backend_tokenizer", None) is None:
            raise InputError(f"the tokenizer of {checkpoint.path} has no fast (tokenizers) version",
                             hint="save it with a tokenizer.json")
        if self.pipeline.lowercase:
            _add_lowercase(self.tokenizer.backend_tokenizer)
        auto = (transformers.AutoModel if self.pipeline.task == "embedding"
                else transformers.AutoModelForSequenceClassification)
        try:
            try:
                model, info = auto.from_pretrained(path, attn_implementation="eager", output_loading_info=True)
            except (TypeError, ValueError):
                model, info = auto.from_pretrained(path, output_loading_info=True)
        except Exception as exc:
            raise self.refused("load", f"the weights do not load: {first_line(exc)}") from exc
        # transformers fills weights missing from the file with random values and only warns: that would be
        # a different model every load. The pooler is the one part trm never uses.
        missing = sorted(k for k in info.get("missing_keys", ()) if "pooler" not in k)
        mismatched = list(info.get("mismatched_keys", ()))
        if missing or mismatched:
            bad = [str(k[0] if isinstance(k, tuple) else k) for k in (*missing, *mismatched)]
            raise self.refused("load", f"the weights do not match config.json ({len(bad)} missing or of another "
                                       f"shape, e.g. {', '.join(bad[:3])})")
        accepted = inspect.signature(model.forward).parameters
        produced = set(getattr(self.tokenizer, "model_input_names", TOKEN_INPUTS))
        # an input the tokenizer does not produce (token_type_ids, say) is left to the model's default
        self.input_names = [n for n in TOKEN_INPUTS if n in accepted and n in produced]
        if self.input_names[:2] != ["input_ids", "attention_mask"]:
            raise self.refused("load", f"the model takes {sorted(accepted)[:6]}, not input_ids and attention_mask")
        prompt_length = self._prompt_length() if not self.pipeline.include_prompt else 0
        self.module = _head_class()(model, self.input_names, self.pipeline, _dense_layers(checkpoint),
                                    prompt_length).eval()
        try:
            self.width = int(self.run(self.encode(example_items(self.pipeline.task)[:1])).shape[1])
        except Exception as exc:
            raise self.refused("load", f"a trial forward pass fails: {first_line(exc)}") from exc

    def refused(self, step: str, message: str) -> InputError:
        return InputError(f"{step}: {self.checkpoint.architecture} checkpoint {self.checkpoint.path}: {message}",
                          hint="nothing was written")

    def _prompt_length(self) -> int:
        """sentence-transformers' prompt length: the prompt's tokens without a trailing special token."""
        if not self.pipeline.prompt:
            return 0
        ids = self.tokenizer([self.pipeline.prompt], truncation=True,
                             max_length=self.checkpoint.max_length)["input_ids"][0]
        return len(ids) - (1 if ids and ids[-1] in self.tokenizer.all_special_ids else 0)

    def encode(self, items: list[Any]) -> dict[str, np.ndarray]:
        """Token tensors as the served tokenizer makes them (prompt prepended, pairs for rerank)."""
        if self.pipeline.task == "rerank":
            batch = self.tokenizer([q for q, _ in items], [p for _, p in items], padding=True, truncation=True,
                                   max_length=self.checkpoint.max_length, return_tensors="np")
        else:
            batch = self.tokenizer([self.pipeline.prompt + t for t in items], padding=True, truncation=True,
                                   max_length=self.checkpoint.max_length, return_tensors="np")
        return {name: np.asarray(batch[name], dtype=np.int64) for name in self.input_names}

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        with self.torch.inference_mode():
            return self.module(*(self.torch.from_numpy(feeds[n]) for n in self.input_names)).numpy()

    def token_count(self, text: str) -> int:
        return len(self.tokenizer(self.pipeline.prompt + text)["input_ids"])

    def export(self, target: Path, *, half: bool = False) -> None:
        """The module as ONNX at ``target``; ``half``: its weights and arithmetic in fp16, the answer cast back to
        fp32 (the service's interface stays the same)."""
        module = _half_of(self.module, self.torch) if half else self.module
        feeds = self.encode(example_items(self.pipeline.task))
        axes = {name: {0: "batch", 1: "sequence"} for name in self.input_names}
        output = OUTPUTS[self.pipeline.task].lower()
        axes[output] = {0: "batch"}
        # dynamo=False: the TorchScript exporter handles dynamic_axes reliably on this torch (2.13). Its
        # tracer warnings (deprecation, traced shape checks) are expected and verification is the real check.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.torch.onnx.export(module, tuple(self.torch.from_numpy(feeds[n]) for n in self.input_names),
                                       str(target), input_names=self.input_names, output_names=[output],
                                       dynamic_axes=axes, opset_version=OPSET, dynamo=False)
        except Exception as exc:
            raise self.refused("export", f"torch.onnx.export fails: {first_line(exc)}") from exc

    def save_tokenizer(self, target: Path) -> None:
        self.tokenizer.backend_tokenizer.save(str(target))


def _half_of(module: Any, torch: Any) -> Any:
    """A copy of ``module`` in fp16 whose answer is cast back to fp32."""

    class Half(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = copy.deepcopy(module).half()

        def forward(self, *inputs: Any) -> Any:
            return self.inner(*inputs).float()

    return Half().eval()


def example_items(task: str) -> list[Any]:
    texts = ["a short example", "and a somewhat longer second example sentence"]
    return [(QUERY, t) for t in texts] if task == "rerank" else texts


def _add_lowercase(backend) -> None:
    """do_lower_case as sentence-transformers applies it: a Lowercase normalizer in front, unless present."""
    from tokenizers.normalizers import Lowercase, Sequence  # noqa: PLC0415 - heavy library, imported where used

    current = backend.normalizer
    if current is None:
        backend.normalizer = Lowercase()
        return
    if isinstance(current, Lowercase) or (isinstance(current, Sequence) and "Lowercase" in repr(current)):
        return
    backend.normalizer = Sequence([Lowercase(), current])


def _dense_layers(checkpoint: Checkpoint) -> list[Any]:
    """torch Linear + activation for each Dense module, with the module's own weights."""

    import torch  # noqa: PLC0415 - torch and its libraries take seconds to import; only this path needs them

    layers = []
    for spec in checkpoint.pipeline.head:
        if spec == "normalize":
            continue
        folder = checkpoint.path / spec.path
        try:
            if (folder / "model.safetensors").is_file():
                from safetensors.torch import load_file  # noqa: PLC0415 - heavy library, imported where used
                state = load_file(str(folder / "model.safetensors"))
            else:
                state = torch.load(str(folder / "pytorch_model.bin"), map_location="cpu", weights_only=True)
            linear = torch.nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
            linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()
                                    if k.startswith("linear.")})
            residual = None
            if spec.residual and spec.in_features != spec.out_features:
                residual = torch.nn.Linear(spec.in_features, spec.out_features, bias=False)
                residual.load_state_dict({k.removeprefix("residual."): v for k, v in state.items()
                                          if k.startswith("residual.")})
            module_name, _, class_name = spec.activation.rpartition(".")
            activation_class = getattr(importlib.import_module(module_name), class_name)
            if not (isinstance(activation_class, type) and issubclass(activation_class, torch.nn.Module)):
                raise TypeError(f"{spec.activation} is not a torch.nn module")
            activation = activation_class()
        except Exception as exc:
            raise InputError(f"load: the Dense module in {folder} cannot be loaded: {first_line(exc)}") from exc
        layers.append((linear, activation, spec.residual, residual))
    return layers


def _head_class():
    import torch  # noqa: PLC0415 - torch and its libraries take seconds to import; only this path needs them

    class Head(torch.nn.Module):
        """encoder -> the checkpoint's head. Pooling mirrors sentence-transformers' Pooling for right-padded
        batches (what the served tokenizer makes); verification compares with the library itself."""

        def __init__(self, model, input_names: list[str], pipeline: Pipeline, dense: list[Any],
                     prompt_length: int) -> None:
            super().__init__()
            self.model = model
            self.input_names = input_names
            self.pipeline = pipeline
            self.dense = torch.nn.ModuleList([torch.nn.ModuleList([lin, act]) for lin, act, _, _ in dense])
            self.residual = [(flag, res) for _, _, flag, res in dense]
            self.residual_layers = torch.nn.ModuleList([res for _, _, _, res in dense if res is not None])
            self.prompt_length = prompt_length

        def forward(self, *tensors):
            kwargs = dict(zip(self.input_names, tensors))
            if self.pipeline.task != "embedding":
                logits = self.model(**kwargs).logits
                if self.pipeline.activation == "sigmoid":
                    return torch.sigmoid(logits)
                if self.pipeline.activation == "softmax":
                    return torch.softmax(logits, dim=-1)
                return logits
            hidden = self.model(**kwargs)[0]
            mask = kwargs["attention_mask"]
            if self.prompt_length:
                mask = mask.clone()
                mask[:, :self.prompt_length] = 0
            x = torch.cat([self.pool(mode, hidden, mask) for mode in self.pipeline.pooling], dim=-1)
            dense = iter(zip(self.dense, self.residual))
            for step in self.pipeline.head:
                if step == "normalize":
                    x = torch.nn.functional.normalize(x, p=2.0, dim=-1)
                    continue
                (linear, activation), (use_residual, projection) = next(dense)
                out = activation(linear(x))
                if use_residual:
                    out = out + (x if projection is None else projection(x))
                x = out
            return x

        @staticmethod
        def pool(mode: str, hidden, mask):
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            if mode == "cls":
                first = mask.to(torch.float32).argmax(dim=1)
                index = first.unsqueeze(-1).unsqueeze(1).expand(-1, 1, hidden.shape[-1])
                return torch.gather(hidden, 1, index).squeeze(1)
            if mode == "max":
                return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
            if mode in ("mean", "mean_sqrt_len_tokens"):
                count = torch.clamp(weights.sum(dim=1), min=1e-9)
                return (hidden * weights).sum(dim=1) / (count if mode == "mean" else torch.sqrt(count))
            if mode == "weightedmean":
                positions = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype).view(1, -1, 1)
                weighted = weights * positions
                return (hidden * weighted).sum(dim=1) / torch.clamp(weighted.sum(dim=1), min=1e-9)
            # lasttoken: the last position the mask keeps
            seq_len = hidden.shape[1]
            values, indices = mask.to(torch.int32).flip(1).max(1)
            indices = torch.where(values == 0, seq_len - 1, indices)
            index = (seq_len - indices - 1).unsqueeze(-1).unsqueeze(1).expand(-1, 1, hidden.shape[-1])
            return torch.gather(hidden * weights, 1, index).squeeze(1)

    return Head


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
