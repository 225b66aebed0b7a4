"""What a Hugging Face checkpoint declares it computes, read from its own files (no weights loaded).

A sentence-transformers checkpoint lists its modules in ``modules.json``; each module's folder holds its
config. trm follows that list exactly and refuses, by name, any module it cannot express in the served
graph, instead of approximating it:

    Transformer   sentence_bert_config.json: max_seq_length, do_lower_case (path "" or a subfolder)
    Pooling       1_Pooling/config.json: pooling_mode (cls, max, mean, mean_sqrt_len_tokens, weightedmean,
                  lasttoken, or several, concatenated in that order) or the older pooling_mode_* keys;
                  include_prompt
    Dense         config.json (in/out features, bias, activation_function, use_residual) + weights
    Normalize     L2 normalisation

``config_sentence_transformers.json`` gives the prompts ("query: ", ...) and ``default_prompt_name``, and
says whether the checkpoint is a ``CrossEncoder`` (a reranker). A plain transformers checkpoint (no
``modules.json``) is served the way ``SentenceTransformer(path)`` loads one: mean pooling, no
normalisation, unless ``--pooling`` / ``--normalize`` say otherwise; a ``*ForSequenceClassification``
checkpoint is a reranker when it has one logit and a classifier when it has several (``--task`` chooses
otherwise).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repo_manager.core.errors import InputError

TASKS = ("embedding", "rerank", "classify")
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
MODULE_KINDS = ("Transformer", "Pooling", "Dense", "Normalize")
SCORE_ACTIVATIONS = ("sigmoid", "softmax", "identity")


@dataclass(frozen=True)
class DenseSpec:
    path: str
    """The module's folder, relative to the checkpoint."""
    in_features: int
    out_features: int
    bias: bool
    activation: str
    """A torch.nn module path, as sentence-transformers stores it (torch.nn.modules.activation.Tanh)."""
    residual: bool = False


@dataclass(frozen=True)
class Pipeline:
    """The served computation: tokenizer settings, encoder, and the head after it."""

    task: str
    origin: str
    """Where the pipeline came from: 'modules.json', 'options' or 'default (as SentenceTransformer(path))'."""
    model_folder: str = ""
    """The transformers model's folder inside the checkpoint ('' for the top)."""
    pooling: tuple[str, ...] = ()
    include_prompt: bool = True
    head: tuple[Any, ...] = ()
    """DenseSpec or 'normalize', in the checkpoint's order."""
    lowercase: bool = False
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    prompt_name: str | None = None
    """The prompt served (the checkpoint's default_prompt_name unless chosen at publish)."""
    activation: str = "identity"
    """rerank/classify: what turns logits into the scores the reference library returns."""
    labels: tuple[str, ...] = ()
    sentence_transformers: bool = False
    """True when the checkpoint is a sentence-transformers folder (modules.json): the reference is that library."""

    @property
    def prompt(self) -> str:
        return self.prompts.get(self.prompt_name, "") if self.prompt_name else ""

    @property
    def normalize(self) -> bool:
        return bool(self.head) and self.head[-1] == "normalize"

    def record(self) -> dict[str, Any]:
        """The manifest's description of the pipeline."""
        data: dict[str, Any] = {"task": self.task, "pipeline_from": self.origin}
        if self.task == "embedding":
            data.update(pooling="+".join(self.pooling), include_prompt=self.include_prompt,
                        head=[h if isinstance(h, str) else {"dense": h.path, "in": h.in_features,
                                                            "out": h.out_features, "activation": h.activation,
                                                            "residual": h.residual} for h in self.head],
                        normalize="l2" if self.normalize else None)
        else:
            data.update(activation=self.activation, labels=list(self.labels))
        data.update(lowercase=self.lowercase, prompt_name=self.prompt_name, prompt=self.prompt)
        return data


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path} does not hold a JSON object")
    return data


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def model_folder(folder: Path) -> Path:
    """The folder with the transformers model: the Transformer module's path when modules.json names one."""
    modules = folder / "modules.json"
    if modules.is_file():
        for module in _modules(folder):
            if _kind(module) == "Transformer":
                return folder / str(module.get("path") or "")
    return folder


def _modules(folder: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{folder / 'modules.json'} is not valid JSON: {exc}") from exc
    if not isinstance(data, list) or not all(isinstance(m, dict) and "type" in m for m in data):
        raise InputError(f"{folder / 'modules.json'} is not a list of modules with a type each")
    return sorted(data, key=lambda m: int(m.get("idx", 0)))


def _kind(module: dict[str, Any]) -> str:
    return str(module["type"]).rsplit(".", 1)[-1]


def read_pipeline(folder: Path, config: dict[str, Any], *, task: str | None = None, pooling: str | None = None,
                  normalize: bool | None = None, prompt_name: str | None = None) -> Pipeline:
    """The checkpoint's pipeline; options only fill in what the checkpoint does not say (a plain checkpoint)
    and may not contradict what it does say."""
    if task is not None and task not in TASKS:
        raise InputError(f"task {task!r} is not supported for Hugging Face checkpoints",
                         hint=f"use one of {', '.join(TASKS)}")
    st_config = _optional_json(folder / "config_sentence_transformers.json")
    architecture = str((config.get("architectures") or [""])[0])
    classifier = architecture.endswith("ForSequenceClassification")
    is_cross_encoder = (st_config.get("model_type") == "CrossEncoder" or "sentence_transformers" in config
                        or "sbert_ce_default_activation_function" in config)
    has_modules = (folder / "modules.json").is_file()
    # One logit and no sentence-transformers config: a cross-encoder saved with save_pretrained (the
    # ms-marco rerankers are), so a reranker; several labels: a classifier
    single_logit = label_count(config) == 1
    detected = ("rerank" if is_cross_encoder or (classifier and single_logit and not has_modules)
                else "classify" if classifier and not has_modules else "embedding")
    if task is None:
        task = detected
    elif task != detected and (is_cross_encoder or has_modules):
        raise InputError(f"the checkpoint is a {_describe(detected)}, it cannot serve --task {task}",
                         hint=f"publish it with --task {detected} (or without --task)")
    if task in ("rerank", "classify") and not classifier:
        raise InputError(f"--task {task} needs a sequence-classification checkpoint; "
                         f"{architecture or 'this checkpoint'} has no classification head",
                         hint="publish it as --task embedding")
    prompts = {str(k): str(v) for k, v in (st_config.get("prompts") or {}).items()}
    if prompt_name is not None and prompt_name not in prompts:
        raise InputError(f"prompt {prompt_name!r} is not one of the checkpoint's prompts",
                         hint=f"its prompts: {', '.join(prompts) or 'none'} (config_sentence_transformers.json)")
    chosen = prompt_name if prompt_name is not None else st_config.get("default_prompt_name")
    chosen = chosen if chosen in prompts else None
    if task != "embedding":
        if pooling is not None or normalize is not None:
            raise InputError(f"--pooling and --normalize apply to embeddings, not to --task {task}")
        if chosen and prompts.get(chosen):
            raise InputError(f"prompts are not supported for --task {task}")
        return _scoring_pipeline(folder, config, st_config, task, has_modules)
    if not has_modules:
        mode = pooling or "mean"
        if mode not in POOLING_MODES:
            raise InputError(f"pooling {mode!r} is not one of {', '.join(POOLING_MODES)}")
        origin = "options" if pooling is not None or normalize else "default (as SentenceTransformer(path))"
        return Pipeline(task="embedding", origin=origin, pooling=(mode,), head=("normalize",) if normalize else (),
                        prompts=prompts, prompt_name=chosen)
    if pooling is not None or normalize is not None:
        raise InputError("the checkpoint's modules.json already says how it pools and normalises",
                         hint="drop --pooling/--normalize: trm serves what the checkpoint declares")
    return _modules_pipeline(folder, prompts, chosen)


def label_count(config: dict[str, Any]) -> int:
    """As transformers reads it: id2label's size, else num_labels, else its default of 2."""
    id2label = config.get("id2label") or {}
    return len(id2label) if id2label else int(config.get("num_labels") or 2)


def _describe(task: str) -> str:
    return {"rerank": "cross-encoder (reranker)", "classify": "text classifier",
            "embedding": "sentence-embedding model"}[task]


def _modules_pipeline(folder: Path, prompts: dict[str, str], prompt_name: str | None) -> Pipeline:
    modules = _modules(folder)
    kinds = [_kind(m) for m in modules]
    unknown = [f"{m['type']}" for m, k in zip(modules, kinds) if k not in MODULE_KINDS]
    if unknown:
        raise InputError(f"module {unknown[0]} in modules.json cannot be served by trm",
                         hint=f"trm serves the sentence-transformers modules {', '.join(MODULE_KINDS)}")
    if not kinds or kinds[0] != "Transformer" or kinds.count("Transformer") != 1:
        raise InputError("modules.json must start with exactly one Transformer module")
    if kinds.count("Pooling") != 1 or kinds[1] != "Pooling":
        raise InputError("modules.json must have one Pooling module right after the Transformer",
                         hint=f"its modules: {', '.join(kinds)}")
    transformer = _optional_json(folder / str(modules[0].get("path") or "") / "sentence_bert_config.json")
    if transformer.get("transformer_task", "feature-extraction") != "feature-extraction":
        raise InputError(f"the Transformer module's task {transformer['transformer_task']!r} is not a "
                         "sentence-embedding encoder")
    pool_config = _optional_json(folder / str(modules[1].get("path") or "") / "config.json")
    modes = _pooling_modes(pool_config)
    head: list[Any] = []
    for module, kind in zip(modules[2:], kinds[2:]):
        path = str(module.get("path") or "")
        if kind == "Normalize":
            head.append("normalize")
            continue
        if kind == "Pooling":
            raise InputError("modules.json has a second Pooling module, which trm cannot serve")
        dense = read_json(folder / path / "config.json")
        if dense.get("module_input_name", "sentence_embedding") != "sentence_embedding" or \
                dense.get("module_output_name", "sentence_embedding") not in (None, "sentence_embedding"):
            raise InputError(f"the Dense module in {path} reads or writes other than the sentence embedding, "
                             "which trm cannot serve")
        activation = str(dense.get("activation_function") or "torch.nn.modules.activation.Tanh")
        if not activation.startswith("torch."):
            raise InputError(f"the Dense module in {path} uses the activation {activation}, which is not a torch "
                             "module", hint="trm serves Dense modules whose activation is a torch.nn module")
        head.append(DenseSpec(path, int(dense["in_features"]), int(dense["out_features"]),
                              bool(dense.get("bias", True)), activation, bool(dense.get("use_residual", False))))
    return Pipeline(task="embedding", origin="modules.json", model_folder=str(modules[0].get("path") or ""),
                    pooling=modes, include_prompt=bool(pool_config.get("include_prompt", True)), head=tuple(head),
                    lowercase=bool(transformer.get("do_lower_case", False)),
                    max_seq_length=transformer.get("max_seq_length"), prompts=prompts, prompt_name=prompt_name,
                    sentence_transformers=True)


def _pooling_modes(config: dict[str, Any]) -> tuple[str, ...]:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(m for key, m in _LEGACY_POOLING.items() if config.get(key))
        modes = modes or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise InputError(f"pooling mode {bad[0]!r} is not one trm (or sentence-transformers) knows",
                         hint=f"known: {', '.join(POOLING_MODES)}")
    return modes


def _scoring_pipeline(folder: Path, config: dict[str, Any], st_config: dict[str, Any], task: str,
                      has_modules: bool) -> Pipeline:
    id2label = config.get("id2label") or {}
    count = label_count(config)
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))
    transformer = _optional_json(folder / "sentence_bert_config.json")
    if has_modules:
        kinds = [_kind(m) for m in _modules(folder)]
        if kinds != ["Transformer"]:
            raise InputError(f"module {kinds[-1]} of this cross-encoder cannot be served by trm",
                             hint="trm serves cross-encoders made of one Transformer module")
    if task == "rerank":
        # sentence-transformers' CrossEncoder: the saved activation, else Sigmoid for one label, else none
        path = (st_config.get("activation_fn") or (config.get("sentence_transformers") or {}).get("activation_fn")
                or config.get("sbert_ce_default_activation_function"))
        if path:
            activation = {"Sigmoid": "sigmoid", "Identity": "identity", "Softmax": "softmax"}.get(
                str(path).rsplit(".", 1)[-1])
            if activation is None:
                raise InputError(f"the cross-encoder's activation {path} cannot be served by trm",
                                 hint=f"trm serves {', '.join(SCORE_ACTIVATIONS)}")
        else:
            activation = "sigmoid" if count == 1 else "identity"
        origin = "CrossEncoder config" if path else "default (as CrossEncoder(path))"
    else:
        # the transformers text-classification pipeline's default function_to_apply
        problem = config.get("problem_type")
        activation = ("identity" if problem == "regression" else
                      "sigmoid" if problem == "multi_label_classification" or count == 1 else "softmax")
        origin = "config.json (as pipeline('text-classification'))"
    return Pipeline(task=task, origin=origin, activation=activation, labels=labels,
                    lowercase=bool(transformer.get("do_lower_case", False)),
                    max_seq_length=transformer.get("max_seq_length"), sentence_transformers=has_modules)
