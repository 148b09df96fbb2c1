"""Loading checkpoints: what loads, and the one-line error for each way one can be broken."""

import json
import shutil

from runtime.checkpoint import DEMO_CHECKPOINT, load_model, resolve_checkpoint
from runtime.config import config_from_dict
from runtime.errors import MAX_CHECKPOINT_MESSAGE, CheckpointError
from runtime.grammar import GrammarCompiler, GrammarSpec
from runtime.synth import hf_config, quantize_weights

import mlx.core as mx
import pytest
from structlog.testing import capture_logs

from tests.runtime.test_files import releasing_fifo


@pytest.fixture
def broken(make_checkpoint, tmp_path):
    """A writable copy of a good tiny checkpoint, to damage."""
    path = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("llama"), path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def error_for(path) -> str:
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unknown_model_type_lists_supported(broken):
    edit_config(broken, model_type="gpt_neox")
    message = error_for(broken)
    assert "config.json" in message and "gpt_neox" in message
    assert all(family in message for family in ("llama", "mistral", "qwen2", "qwen3"))


def test_missing_config_field_is_named(broken):
    edit_config(broken, hidden_size=None)
    message = error_for(broken)
    assert "config.json" in message and "hidden_size" in message


def test_wrong_config_type_is_named(broken):
    edit_config(broken, num_hidden_layers="two")
    assert "num_hidden_layers" in error_for(broken)


@pytest.mark.parametrize(
    "quantization",
    [
        {"group_size": 32, "bits": 4, "mode": "fp3"},
        {"group_size": 32, "bits": 4, "model.layers.0.mlp.up_proj": {"bits": 4, "mode": "fp3"}},
    ],
    ids=["model", "layer"],
)
def test_an_unknown_quantization_mode_is_named_with_the_supported_ones(broken, quantization):
    edit_config(broken, quantization=quantization)
    message = error_for(broken)
    assert "'fp3'" in message and all(m in message for m in ("affine", "mxfp4", "nvfp4", "mxfp8"))


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"group_size": 0, "bits": 4}, "positive integer"),  # mlx divided by it: SIGFPE
        ({"group_size": 32, "bits": -4}, "positive integer"),
        ({"group_size": 32, "bits": 4, "model.layers.0.mlp.up_proj": {"group_size": 0}}, "up_proj"),
        # Refused by mlx itself. (A default it refuses is never used: as in mlx-lm, the
        # layers config.json does not name take the packing their tensors show.)
        ({"group_size": 32, "bits": 4, "model.layers.0.mlp.up_proj": {"group_size": 32, "bits": 99}},
         "bits 99"),
        ({"group_size": 32, "bits": 4, "model.layers.1.mlp.down_proj": {"group_size": 7, "bits": 4}},
         "model.layers.1.mlp.down_proj"),
    ],
    ids=["zero-group", "negative-bits", "zero-layer-group", "mlx-bits", "mlx-layer-group"],
)
def test_quantization_parameters_mlx_cannot_take_are_a_one_line_error(
    make_checkpoint, tmp_path, quantization, named
):
    path = tmp_path / "quantized"
    shutil.copytree(make_checkpoint("llama", quantize=(32, 4), hidden_size=128, intermediate_size=256), path)
    edit_config(path, quantization=quantization)
    assert named in error_for(path)


@pytest.mark.parametrize(
    ("rope_scaling", "named"),
    [
        ({"rope_type": "linear", "factor": 0}, "'factor', got 0"),  # was a ZeroDivisionError
        ({"rope_type": "linear"}, "'factor', got None"),  # was a KeyError
        ({"type": "linear", "factor": -2.0}, "'factor', got -2.0"),
        ({"rope_type": "llama3", "factor": 0}, "'factor'"),  # was non-finite logits
        ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4}, "above"),
        ({"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": "8k"}, "original"),
    ],
    ids=["linear-zero", "linear-missing", "linear-negative", "llama3-zero", "llama3-equal", "llama3-text"],
)
def test_rope_scaling_numbers_rope_cannot_use_are_named(broken, rope_scaling, named):
    edit_config(broken, rope_scaling=rope_scaling)
    message = error_for(broken)
    assert "rope_scaling" in message and named in message


def test_query_heads_that_do_not_share_kv_heads_evenly_are_named(broken):
    edit_config(broken, num_attention_heads=6, num_key_value_heads=4)
    message = error_for(broken)
    assert "num_attention_heads (6)" in message and "num_key_value_heads (4)" in message


def test_eos_ids_come_from_both_config_files(broken):
    edit_config(broken, eos_token_id=7)
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 3]}))
    assert set(load_model(broken).config.eos_token_ids) == {2, 3, 7}
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    assert set(load_model(broken).config.eos_token_ids) == {2, 3, 7}


def _damage(file, how):
    if how == "invalid JSON":
        file.write_text('{"eos_token_id": [2, 3],}')
    elif how == "no object":
        file.write_text("[2, 3]")
    elif how == "nested too deeply":
        file.write_text("[" * 100_000 + "]" * 100_000)
    elif how == "a directory":
        file.unlink()
        file.mkdir()
    else:  # a link that loops
        file.unlink()
        file.symlink_to(file.name)


@pytest.mark.parametrize("how", ["invalid JSON", "no object", "nested too deeply", "a directory", "a loop"])
def test_a_generation_config_that_cannot_be_read_is_skipped_with_a_warning(broken, how):
    """It only adds EOS ids: transformers loads such a checkpoint (its from_pretrained
    catches the OSError and derives one from config.json) and mlx-lm skips invalid JSON;
    a checkpoint whose config.json and weights are sound was refused here."""
    edit_config(broken, eos_token_id=7)
    _damage(broken / "generation_config.json", how)
    with capture_logs() as logs:
        loaded = load_model(broken)
    assert set(loaded.config.eos_token_ids) == {7, *loaded.tokenizer.eos_token_ids}
    (warning,) = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warning["event"] == "generation_config.json skipped"
    assert "generation_config.json: " in warning["problem"] and "\n" not in warning["problem"]


def test_an_eos_id_that_is_no_token_is_none_and_grammars_still_compile(broken):
    """Kept, an id past the vocabulary (or negative) made llguidance refuse every grammar."""
    vocab_size = json.loads((broken / "config.json").read_text())["vocab_size"]
    edit_config(broken, eos_token_id=[vocab_size, -1, True, 3])
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab_size + 7}))
    loaded = load_model(broken)
    assert set(loaded.config.eos_token_ids) == {3, *loaded.tokenizer.eos_token_ids}
    compiler = GrammarCompiler(loaded.tokenizer, vocab_size, loaded.config.eos_token_ids)
    assert compiler.compile(GrammarSpec("regex", "[a-z]+", "guided_regex")) is not None


def test_missing_tensor_is_named(broken):
    weights = mx.load(str(broken / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    assert "model.layers.1.mlp.down_proj.weight" in error_for(broken)


def test_misshapen_tensor_is_named(broken):
    weights = mx.load(str(broken / "model.safetensors"))
    weights["model.norm.weight"] = mx.ones((3,))
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    message = error_for(broken)
    assert "model.norm.weight" in message and "(3,)" in message


def test_a_weight_misshapen_in_its_input_dimension_is_named(broken):
    """mlx's update takes any shape: a projection whose in-features differ loaded and
    failed only in the first forward pass."""
    weights = mx.load(str(broken / "model.safetensors"))
    out_features, in_features = weights["model.layers.0.self_attn.q_proj.weight"].shape
    weights["model.layers.0.self_attn.q_proj.weight"] = mx.ones((out_features, in_features + 1))
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    message = error_for(broken)
    assert "q_proj.weight" in message and f"({out_features}, {in_features + 1})" in message


def test_truncated_safetensors_names_the_file(broken):
    file = broken / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    message = error_for(broken)
    assert "model.safetensors" in message and "truncated" in message


def test_garbage_safetensors_names_the_file(broken):
    (broken / "model.safetensors").write_bytes(b"\x05\x00")
    assert "model.safetensors" in error_for(broken)


def test_missing_config_and_missing_dir(broken, tmp_path):
    (broken / "config.json").unlink()
    assert "config.json" in error_for(broken)
    assert "no such directory" in error_for(tmp_path / "nowhere")


def test_a_checkpoint_named_through_dot_or_dot_dot_is_served_under_its_directorys_name(tmp_path, monkeypatch):
    """`cadence serve --model .` from inside a checkpoint served a model named '' (and
    `--model sub/..` one named '..'): an id no client could send. A symlink keeps its own
    name (a "latest" link is what its user asks for)."""
    checkpoint = tmp_path / "my-model"
    (checkpoint / "sub").mkdir(parents=True)
    (tmp_path / "latest").symlink_to(checkpoint)
    monkeypatch.chdir(checkpoint)
    for given in (".", "./", "sub/..", str(checkpoint / "sub" / "..")):
        assert resolve_checkpoint(given) == (checkpoint.resolve(), "my-model"), given
    assert resolve_checkpoint(str(tmp_path / "latest"))[1] == "latest"


def test_unknown_repo_id_offline_is_a_clean_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint("nobody/no-such-model", offline=True)
    assert "nobody/no-such-model" in str(err.value)


def test_a_hub_snapshot_fetches_only_the_top_level_files_it_reads(broken, tmp_path, monkeypatch):
    """A Mistral repo also holds consolidated.safetensors (the same weights in Mistral's
    names, as large again) and other formats in folders: none of them is fetched."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    mx.save_safetensors(str(broken / "consolidated.safetensors"), {"layers.0.attention.wq.weight": mx.zeros((4, 4))})
    (broken / "original").mkdir()
    (broken / "original" / "params.json").write_text("{}")
    repo = [str(f.relative_to(broken)) for f in broken.rglob("*") if f.is_file()]
    fetched = tmp_path / "snapshot"

    def snapshot_download(repo_id, *, allow_patterns, ignore_patterns=None, local_files_only):
        wanted = huggingface_hub.utils.filter_repo_objects(
            repo, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns
        )
        for name in wanted:  # the filter snapshot_download applies to the repo's files
            (fetched / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(broken / name, fetched / name)
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = load_model("mistralai/some-model")
    assert loaded.name == "mistralai/some-model" and loaded.config.num_hidden_layers == 2
    assert sorted(f.name for f in fetched.iterdir()) == sorted(
        f.name for f in broken.iterdir() if f.is_file() and f.name != "consolidated.safetensors"
    )


def test_a_hub_snapshot_fetches_the_tool_use_template_transformers_saves_in_a_folder(
    broken, tmp_path, monkeypatch
):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    folders = ("additional_chat_templates/tool_use.jinja", "original/params.json", "onnx/model.safetensors")
    for name in folders:
        (broken / name).parent.mkdir(exist_ok=True)
        (broken / name).write_text("{{ tools | tojson }}" if name.endswith(".jinja") else "{}")
    repo = [str(f.relative_to(broken)) for f in broken.rglob("*") if f.is_file()]
    fetched = tmp_path / "snapshot"

    def snapshot_download(repo_id, *, allow_patterns, ignore_patterns=None, local_files_only):
        for name in huggingface_hub.utils.filter_repo_objects(
            repo, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns
        ):
            (fetched / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(broken / name, fetched / name)
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = load_model("NousResearch/some-model")
    assert loaded.tokenizer.tool_use_template_source == "{{ tools | tojson }}"
    assert sorted(f.parent.name for f in fetched.glob("*/*")) == ["additional_chat_templates"]


def test_a_consolidated_safetensors_beside_the_model_files_is_left_alone_as_by_mlx_lm(broken):
    mx.save_safetensors(str(broken / "consolidated.safetensors"), {"layers.0.attention.wq.weight": mx.zeros((4, 4))})
    assert load_model(broken).config.num_hidden_layers == 2


def test_sharded_and_quantized_checkpoints_load(make_checkpoint):
    sharded = load_model(make_checkpoint("llama", shards=2))
    assert sharded.model.model.layers[1].self_attn.o_proj.weight.dtype == mx.float32
    quantized = load_model(make_checkpoint("llama", quantize=(32, 4), hidden_size=128, intermediate_size=256), keep_dtype=True)
    assert quantized.config.quantization.bits == 4
    assert quantized.model.model.layers[0].mlp.up_proj.weight.dtype == mx.uint32


def test_loading_a_sharded_checkpoint_reports_each_shard_by_number(make_checkpoint):
    path = make_checkpoint("llama", shards=2)
    lines = []
    load_model(path, on_progress=lines.append)
    assert lines[0] == f"reading {path.resolve()}"
    assert [line for line in lines if line.startswith("loading weights")] == [
        "loading weights 1/2: model-00001-of-00002.safetensors",
        "loading weights 2/2: model-00002-of-00002.safetensors",
    ]


def test_half_precision_is_upcast_on_cpu_unless_kept(make_checkpoint):
    path = make_checkpoint("qwen2", dtype="bfloat16")
    assert load_model(path).model.model.norm.weight.dtype == mx.float32
    assert load_model(path, keep_dtype=True).model.model.norm.weight.dtype == mx.bfloat16


def test_demo_checkpoint_loads():
    loaded = load_model(None)
    assert loaded.path == DEMO_CHECKPOINT and loaded.name == "cadence-demo"
    assert loaded.config.eos_token_ids
    assert loaded.tokenizer.has_chat_template


def mixed_checkpoint(make_checkpoint, path, layers, quantization, default=(32, 4, "affine")):
    """A tiny llama whose projections are packed as `default` (group size, bits, mode),
    except those `layers` names ({module path: (group_size, bits, mode)}), with
    `quantization` as config.json's field."""
    shutil.copytree(make_checkpoint("llama", hidden_size=128, intermediate_size=256), path)
    mixed = {}
    for name, w in mx.load(str(path / "model.safetensors")).items():
        if name.endswith("proj.weight"):
            spec = layers.get(name.removesuffix(".weight"), default)
            mixed.update(quantize_weights({name: w}, *spec))
        else:
            mixed[name] = w
    mx.save_safetensors(str(path / "model.safetensors"), mixed, metadata={"format": "mlx"})
    edit_config(path, quantization=quantization)
    return path


def load_like_mlx_lm(path):
    """The checkpoint as stored (keep_dtype), once its logits are checked against mlx-lm's."""
    import mlx_lm

    loaded = load_model(path, keep_dtype=True)
    peer, _ = mlx_lm.load(str(path))
    tokens = mx.array([[5, 17, 99, 3, 44]])
    assert mx.allclose(loaded.model(tokens), peer(tokens), atol=1e-4).item()
    return loaded


def test_mixed_precision_quantization_loads_like_mlx_lm(make_checkpoint, tmp_path):
    """mlx-community's mixed quants give some layers their own bits in config.json."""
    down_proj = "model.layers.0.mlp.down_proj"
    path = mixed_checkpoint(
        make_checkpoint, tmp_path / "mixed", {down_proj: (32, 8, "affine")},
        {"group_size": 32, "bits": 4, down_proj: {"group_size": 32, "bits": 8}},
    )
    loaded = load_like_mlx_lm(path)
    assert loaded.model.model.layers[0].mlp.down_proj.bits == 8
    assert loaded.model.model.layers[1].mlp.down_proj.bits == 4


def test_a_layer_can_take_another_quantization_mode(make_checkpoint, tmp_path):
    """mlx-lm gives a per-layer entry its own mode as well as its own bits."""
    down_proj = "model.layers.0.mlp.down_proj"
    path = mixed_checkpoint(
        make_checkpoint, tmp_path / "mixed_modes", {down_proj: (32, 8, "mxfp8")},
        {"group_size": 32, "bits": 4, "mode": "affine",
         down_proj: {"group_size": 32, "bits": 8, "mode": "mxfp8"}},
    )
    loaded = load_like_mlx_lm(path)
    assert loaded.model.model.layers[0].mlp.down_proj.mode == "mxfp8"
    assert loaded.model.model.layers[1].mlp.down_proj.mode == "affine"


def test_a_null_group_size_in_a_layer_entry_is_the_modes_default_as_in_mlx_lm(make_checkpoint, tmp_path):
    """mlx-lm's mixed recipes (`--quant-predicate mixed_4_6`) write a layer's group_size
    as null: mlx then takes the mode's default (64 for affine), not the top-level one."""
    v_projs = [f"model.layers.{i}.self_attn.v_proj" for i in range(2)]
    path = mixed_checkpoint(
        make_checkpoint, tmp_path / "recipe", {v: (64, 6, "affine") for v in v_projs},
        {"group_size": 32, "bits": 4, "mode": "affine",
         **{v: {"group_size": None, "bits": 6, "mode": "affine"} for v in v_projs}},
    )
    loaded = load_like_mlx_lm(path)
    v_proj = loaded.model.model.layers[1].self_attn.v_proj
    assert (v_proj.group_size, v_proj.bits) == (64, 6)
    assert loaded.model.model.layers[1].self_attn.q_proj.group_size == 32


@pytest.mark.parametrize(
    ("layers", "quantization"),
    [
        ({"model.layers.0.mlp.down_proj": (32, 8, "affine"), "model.layers.1.mlp.up_proj": (64, 4, "affine"),
          "model.layers.1.self_attn.o_proj": (32, 8, "mxfp8")}, {"group_size": 32, "bits": 4}),
        ({}, {"group_size": 32, "bits": 99}),
        ({}, {"group_size": 32, "bits": 4, "mode": "mxfp4"}),
        ({"model.layers.1.mlp.up_proj": (128, 4, "affine")}, {"group_size": 32, "bits": 4}),
    ],
    ids=["unnamed-layers", "default-mlx-refuses", "default-mode-not-stored", "one-group-a-row"],
)
def test_layers_the_config_does_not_name_take_the_packing_their_tensors_show_as_in_mlx_lm(
    make_checkpoint, tmp_path, layers, quantization
):
    """mlx-lm reads an unnamed layer's group size and bits from its shapes and its mode
    from its scales' dtype; cadence applied config.json's default, and an 8-bit layer in
    a 4-bit checkpoint was "has shape (128, 64), expected (128, 32)"."""
    from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy

    path = mixed_checkpoint(make_checkpoint, tmp_path / "unnamed", layers, quantization)
    modules = dict(load_like_mlx_lm(path).model.named_modules())
    for name, packing in {"model.layers.0.mlp.up_proj": (32, 4, "affine"), **layers}.items():
        assert (modules[name].group_size, modules[name].bits, modules[name].mode) == packing
    prompt = [5, 17, 99, 3, 44, 250, 1000, 7]
    assert greedy(load_model(path), prompt, 12) == mlx_lm_greedy(path, prompt, 12)


def replace_layer_tensors(path, layer, tensors):
    weights = dict(mx.load(str(path / "model.safetensors")))
    weights.update({f"{layer}.{name}": tensor for name, tensor in tensors.items()})
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})


@pytest.mark.parametrize(
    "tensors",
    [  # down_proj has 256 inputs
        {"weight": mx.zeros((128, 32), mx.uint32), "scales": mx.ones((128, 3)), "biases": mx.zeros((128, 3))},
        {"weight": mx.zeros((128, 64), mx.uint32), "scales": mx.zeros((128, 16), mx.uint8)},
        {"weight": mx.zeros((128, 30), mx.uint32), "scales": mx.ones((128, 8)), "biases": mx.zeros((128, 8))},
        {"weight": mx.zeros((128, 32), mx.uint32), "scales": mx.array(1.0), "biases": mx.array(0.0)},
    ],
    ids=["groups-not-dividing", "no-microscaling-mode", "words-not-dividing", "scalar-scales"],
)
def test_a_layer_whose_packing_no_quantization_fits_is_named_with_its_shapes(
    make_checkpoint, tmp_path, tensors
):
    """mlx-lm refuses these too (a group size mlx has no kernel for, or "Cannot infer the
    quantization mode"); cadence's message names the layer and what its tensors hold."""
    import mlx_lm

    down_proj = "model.layers.1.mlp.down_proj"
    path = mixed_checkpoint(make_checkpoint, tmp_path / "unfit", {}, {"group_size": 32, "bits": 4})
    replace_layer_tensors(path, down_proj, tensors)
    with pytest.raises(Exception):  # noqa: B017 (mlx-lm raises ValueError or mlx's own)
        mlx_lm.load(str(path))
    message = error_for(path)
    assert f"layer '{down_proj}' is stored packed" in message and "256 inputs" in message
    assert str(tuple(tensors["weight"].shape)) in message
    assert str(tuple(tensors["scales"].shape)) in message


def test_a_packing_read_over_a_wrong_hidden_size_names_the_size(make_checkpoint, tmp_path):
    """A hidden_size half the stored one reads q_proj's packing as groups of 16,
    which mlx refuses: "group size 16 is not supported" alone named no size."""
    path = mixed_checkpoint(make_checkpoint, tmp_path / "half", {}, {"group_size": 32, "bits": 4})
    edit_config(path, hidden_size=64)  # stored: 128
    message = error_for(path)
    assert "layer 'model.layers.0.self_attn.q_proj'" in message and "group size 16" in message
    assert "as 8 bits in groups of 16 over the 64 inputs the config gives it" in message


def test_a_packed_layer_stored_without_its_weight_is_a_missing_tensor(make_checkpoint, tmp_path):
    """Scales and biases with no packed weight beside them (a shard cut short, a
    renamed tensor): the packing read from the tensors was a KeyError traceback."""
    down_proj = "model.layers.1.mlp.down_proj"
    path = mixed_checkpoint(make_checkpoint, tmp_path / "no-weight", {}, {"group_size": 32, "bits": 4})
    weights = dict(mx.load(str(path / "model.safetensors")))
    del weights[f"{down_proj}.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    assert f"missing tensor '{down_proj}.weight'" in error_for(path)


@pytest.mark.parametrize(
    "quantization",
    [
        {"group_size": "64", "bits": 4},
        {"group_size": 64, "bits": 4, "model.layers.0.mlp.up_proj": {"group_size": 64, "bits": "4"}},
    ],
    ids=["model", "layer"],
)
def test_a_non_integer_quantization_field_is_named_briefly(broken, quantization):
    edit_config(broken, quantization={**quantization, **{f"layer{i}": {"bits": 4} for i in range(200)}})
    message = error_for(broken)
    assert "group_size" in message and "bits" in message and len(message) < 300


@pytest.mark.parametrize("layers", [200, 1], ids=["more", "fewer"])
def test_a_layer_count_the_weights_do_not_have_is_named_before_building(broken, layers):
    """Building layers the weights lack took minutes and gigabytes at 10**6 of them."""
    edit_config(broken, num_hidden_layers=layers)
    message = error_for(broken)
    assert f"num_hidden_layers is {layers}" in message and "2 layers" in message


def test_a_layer_count_beyond_any_model_is_refused_with_the_config(broken):
    """Families build per-layer lists while reading the config, before the weights are counted."""
    raw = json.loads((broken / "config.json").read_text())
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        config_from_dict({**raw, "num_hidden_layers": 10**6})


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"vocab_size": 10**12}, "vocab_size"),  # was mlx's OverflowError
        # head_dim hidden // heads came to 0: a ZeroDivisionError
        ({"num_attention_heads": 10**6, "num_key_value_heads": 1}, "num_attention_heads"),
        ({"num_attention_heads": 2**16, "num_key_value_heads": 2**16, "head_dim": 2**16},
         "too large"),  # each fits int32, q_proj's rows (heads * head_dim) do not
        # RoPE rotates pairs: a head of one dimension was a ZeroDivisionError
        ({"head_dim": 1}, "RoPE would rotate 1 of each head's dimensions"),
        ({"hidden_size": 7}, "RoPE would rotate 1 of each head's dimensions"),  # 7 // 4 heads
    ],
    ids=["int32", "head-dim-zero", "int32-product", "head-dim-one", "hidden-size-seven"],
)
def test_sizes_the_model_cannot_be_built_with_are_named(broken, changes, named):
    edit_config(broken, **changes)
    assert named in error_for(broken)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"hidden_size": [0] * 100_000}, "field 'hidden_size' should be int, got [0, 0"),
        ({"model_type": "x" * 100_000}, "unsupported model_type 'xxx"),
        ({"hidden_act": "gelu" * 25_000}, "hidden_act 'gelugelu"),
    ],
    ids=["list", "model-type", "activation"],
)
def test_a_config_value_of_100_000_items_is_quoted_briefly(broken, changes, named):
    """Each was quoted whole: a 300 KB message from a 300 KB config.json."""
    edit_config(broken, **changes)
    message = error_for(broken)
    assert named in message and len(message) < MAX_CHECKPOINT_MESSAGE + 100


def write_safetensors(file, header, data=b"\0" * 8):
    """A safetensors file with this header (a JSON value, or raw bytes) and data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def entry(**changes):
    return {"model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **changes}}


@pytest.mark.parametrize(
    ("header", "named"),
    [
        ([1, 2], "not a JSON object"),  # was AttributeError
        ("text", "not a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "corrupt"),  # was RecursionError
        (b'{"n": ' + b"1" * 5000 + b"}", "corrupt"),  # was ValueError (past 4,300 digits)
        ({"model.norm.weight": [0, 8]}, "not an object"),
        (entry(data_offsets=[0]), "data_offsets"),  # was IndexError
        (entry(data_offsets="zz"), "data_offsets"),  # was TypeError
        (entry(data_offsets=[8, 0]), "data_offsets"),
        (entry(dtype=5), "dtype"),
        (entry(shape=["2"]), "shape"),
        (entry(shape=[-1]), "shape"),
    ],
    ids=["list", "string", "deep", "digits", "entry-list", "one-offset", "text-offsets", "backwards", "dtype",
         "text-shape", "negative-shape"],
)
def test_a_malformed_safetensors_header_is_named(broken, header, named):
    write_safetensors(broken / "model.safetensors", header)
    message = error_for(broken)
    assert "model.safetensors" in message and named in message


def test_a_tensor_name_with_a_newline_stays_on_one_line(broken):
    weights = mx.load(str(broken / "model.safetensors"))
    mx.save_safetensors(str(broken / "model.safetensors"), {**weights, "odd\nname": mx.ones((2,))})
    assert "odd\\nname" in error_for(broken)  # error_for checks for a newline
    bad_length = {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}  # mlx refuses it
    write_safetensors(broken / "model.safetensors", {"odd\nname": bad_length})
    assert "odd" in error_for(broken)  # mlx's error for it, made one line


def write_index(path, weight_map):
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shard", [5, None, ["model.safetensors"]], ids=["number", "null", "list"])
def test_an_index_naming_shards_by_anything_but_a_string_is_named(broken, shard):
    write_index(broken, {"model.norm.weight": shard})  # a number was a TypeError
    message = error_for(broken)
    assert "model.safetensors.index.json" in message and "weight_map" in message


def test_an_index_with_an_empty_weight_map_says_so(broken):
    write_index(broken, {})  # beside model.safetensors: "no *.safetensors weight files"
    assert "model.safetensors.index.json: weight_map is empty" in error_for(broken)


@pytest.mark.parametrize("index", [[1, 2], {"metadata": {"total_size": 8}}], ids=["list", "no-map"])
def test_an_index_without_a_weight_map_says_so(broken, index):
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model.safetensors.index.json: no weight_map" in error_for(broken)


@pytest.mark.parametrize("shard", ["", "."], ids=["empty", "dot"])
def test_an_index_naming_the_checkpoint_directory_as_a_shard_is_named(broken, shard):
    write_index(broken, {"model.norm.weight": shard})  # was "<dir>: not a regular file"
    message = error_for(broken)
    assert f"model.safetensors.index.json: names shard {shard!r}, which is no file name" in message


def sharded_copy(make_checkpoint, path):
    shutil.copytree(make_checkpoint("llama", shards=2), path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return index["weight_map"]


def test_a_tensor_the_index_puts_in_a_shard_that_lacks_it_is_named(make_checkpoint, tmp_path):
    weight_map = sharded_copy(make_checkpoint, tmp_path / "sharded")
    first = tmp_path / "sharded" / "model-00001-of-00002.safetensors"
    weights = dict(mx.load(str(first)))
    weights.pop("model.embed_tokens.weight")
    mx.save_safetensors(str(first), weights)
    assert weight_map["model.embed_tokens.weight"] == first.name
    message = error_for(tmp_path / "sharded")  # was "missing tensor", not saying where
    assert ("model.safetensors.index.json: names tensor 'model.embed_tokens.weight' in shard "
            "'model-00001-of-00002.safetensors', which does not hold it") in message


def test_a_tensor_the_index_puts_in_the_wrong_shard_still_loads_as_in_mlx_lm(make_checkpoint, tmp_path):
    """mlx-lm reads every model*.safetensors and no index: the weights are whole."""
    weight_map = sharded_copy(make_checkpoint, tmp_path / "sharded")
    weight_map["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    write_index(tmp_path / "sharded", weight_map)
    assert load_model(tmp_path / "sharded").config.num_hidden_layers == 2


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_an_index_naming_a_shard_outside_the_checkpoint_is_refused(broken, tmp_path, where):
    outside = tmp_path / "outside.safetensors"  # a complete set of weights: it would load
    shutil.move(broken / "model.safetensors", outside)
    shard = "../outside.safetensors" if where == "relative" else str(outside)
    write_index(broken, {"model.norm.weight": shard})
    message = error_for(broken)
    assert "outside the checkpoint" in message and "outside.safetensors" in message


def test_a_shard_linked_from_outside_loads_as_in_the_hugging_face_cache(broken, tmp_path):
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    shutil.move(broken / "model.safetensors", blob)
    (broken / "model.safetensors").symlink_to(blob)
    write_index(broken, {"model.norm.weight": "model.safetensors"})
    assert load_model(broken).config.num_hidden_layers == 2


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ],
)
def test_deeply_nested_json_is_a_checkpoint_error(broken, name):
    (broken / name).write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError
    assert name in error_for(broken)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_an_unpaired_surrogate_escape_is_a_checkpoint_error(broken, name):
    """Python's json makes a string of "\\ud800", which nothing can encode: a special
    token spelled so was a UnicodeEncodeError traceback while the tokenizer was built."""
    config = json.loads((broken / name).read_text())
    config["unk_token" if name == "tokenizer_config.json" else "_name_or_path"] = "\ud800x"
    (broken / name).write_text(json.dumps(config))
    assert f"{name}: not valid JSON (a \\u escape of half a UTF-16 surrogate pair" in error_for(broken)


def test_a_config_json_that_is_a_directory_is_named(broken):
    (broken / "config.json").unlink()
    (broken / "config.json").mkdir()  # was IsADirectoryError
    assert "config.json" in error_for(broken)


@pytest.mark.parametrize(
    "name",
    ["config.json", "tokenizer.json", "chat_template.jinja", "model.safetensors.index.json"],
)
def test_a_fifo_in_the_checkpoint_is_refused_not_waited_on(broken, name):
    if (broken / name).exists():
        (broken / name).unlink()
    timer = releasing_fifo(broken / name)  # a reader blocked forever here
    try:
        assert f"{name}: not a regular file" in error_for(broken)
    finally:
        timer.cancel()


@pytest.mark.parametrize("indexed", [False, True], ids=["globbed", "indexed"])
def test_a_directory_by_a_weight_files_name_is_named(broken, indexed):
    (broken / "model.safetensors").unlink()
    (broken / "model.safetensors").mkdir()  # was a bare "Is a directory"
    if indexed:
        write_index(broken, {"model.norm.weight": "model.safetensors"})
    assert "model.safetensors: not a regular file" in error_for(broken)


def test_a_model_name_too_long_for_the_file_system_is_a_short_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint(str(tmp_path / ("x" * 5000)))  # was OSError from is_dir
    message = str(info.value)
    assert "File name too long" in message and len(message) < 400


def llama_config(**changes):
    """A small llama config.json dict, with fields replaced or (None) left out."""
    raw = hf_config(
        "llama", vocab_size=300, eos_token_id=[2], hidden_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, intermediate_size=128,
    )
    raw.update(changes)
    return {key: value for key, value in raw.items() if value is not None}


def test_fields_a_config_leaves_out_take_their_defaults():
    config = config_from_dict(
        llama_config(
            num_key_value_heads=None, rms_norm_eps=None, rope_theta=None,
            max_position_embeddings=None, tie_word_embeddings=None,
        )
    )
    assert config.num_key_value_heads == config.num_attention_heads == 4  # no GQA said: none
    assert config.rms_norm_eps == 1e-6 and config.rope_theta == 10000.0
    assert config.max_position_embeddings == 4096
    assert config.tie_word_embeddings is None  # decided from the weights at load
    assert config.head_dim == 16  # hidden_size / num_attention_heads


def test_a_null_kv_head_count_is_one_per_query_head_as_in_mlx_lm(make_checkpoint, tmp_path):
    path = tmp_path / "mha"
    shutil.copytree(make_checkpoint("llama", num_kv_heads=4), path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "num_key_value_heads": None}))
    assert load_like_mlx_lm(path).config.num_key_value_heads == 4


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "unsupported rope_scaling type 'longrope'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": float("inf")}}, "'factor', got inf"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": float("nan")}}, "'factor', got nan"),
        ({"vocab_size": 2**31}, "too large"),
        # Rotating part of each head: transformers honours it; run whole, every token was off.
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported for model_type 'llama'"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}}, "rope_parameters.partial_rotary_factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
         "rope_scaling.partial_rotary_factor"),
        # NaN passed the positive check (NaN <= 0 is false): every request then failed.
        ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' must be a finite number, got nan"),
        ({"rope_theta": float("inf")}, "'rope_theta' must be a finite number, got inf"),
    ],
    ids=[
        "mlp-bias", "longrope-outside-phi3", "dynamic", "infinite-factor", "nan-factor", "past-int32",
        "partial-rotary", "partial-rotary-in-rope-parameters", "partial-rotary-in-rope-scaling", "nan-eps",
        "infinite-theta",
    ],
)
def test_config_settings_cadence_cannot_honour_are_named(changes, named):
    with pytest.raises(CheckpointError, match="config.json") as error:
        config_from_dict(llama_config(**changes))
    assert named in str(error.value)


def test_a_whole_rotary_factor_is_accepted_where_heads_rotate_whole():
    assert config_from_dict(llama_config(partial_rotary_factor=1.0)).head_dim == 16


def test_the_largest_int32_size_is_accepted():
    assert config_from_dict(llama_config(vocab_size=2**31 - 1)).vocab_size == 2**31 - 1


def test_llama3_rope_scaling_may_leave_its_frequency_factors_to_the_defaults():
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert config_from_dict(llama_config(rope_scaling=scaling)).rope_scaling == scaling


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "default"},  # nothing to scale by: no factor to check
        {"type": "linear", "factor": 2.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
    ],
    ids=["default-without-factor", "linear-with-llama3-fields"],
)
def test_a_rope_scaling_is_checked_only_for_the_numbers_its_type_uses(scaling):
    assert config_from_dict(llama_config(rope_scaling=scaling)).rope_scaling == scaling


def test_a_layer_entry_without_a_mode_is_affine_as_mlx_takes_it():
    """mlx-lm hands a layer's entry to mlx's to_quantized, whose mode defaults to affine:
    in an mxfp4 checkpoint, {"bits": 8} is an affine layer (it was taken as mxfp4)."""
    quantization = {
        "group_size": 32, "bits": 4, "mode": "mxfp4",
        "model.layers.0.mlp.up_proj": {"bits": 8},
        "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8, "mode": "mxfp8"},
    }
    q = config_from_dict(llama_config(quantization=quantization)).quantization
    assert (q.group_size, q.bits, q.mode) == (32, 4, "mxfp4")
    assert q.per_layer == {
        "model.layers.0.mlp.up_proj": (None, 8, "affine"),
        "model.layers.0.mlp.down_proj": (32, 8, "mxfp8"),
    }


def test_an_mxfp4_checkpoint_with_an_affine_layer_entry_without_a_mode_loads_as_mlx_lm(
    make_checkpoint, tmp_path
):
    """mlx-lm's MoE recipes write {"group_size": 64, "bits": 8} entries (no mode) into
    mxfp4 checkpoints; cadence refused them ("mxfp4 quantization requires group size 32")."""
    from tests.kernels.test_quantized_models import greedy, mlx_lm_greedy

    down_proj = "model.layers.0.mlp.down_proj"
    path = mixed_checkpoint(
        make_checkpoint, tmp_path / "mxfp4", {down_proj: (64, 8, "affine")},
        {"group_size": 32, "bits": 4, "mode": "mxfp4", down_proj: {"group_size": 64, "bits": 8}},
        default=(32, 4, "mxfp4"),
    )
    modules = dict(load_like_mlx_lm(path).model.named_modules())
    assert (modules[down_proj].group_size, modules[down_proj].bits) == (64, 8)
    assert modules[down_proj].mode == "affine" and modules["model.layers.0.mlp.up_proj"].mode == "mxfp4"
    prompt = [5, 17, 99, 3, 44, 250, 1000, 7]
    assert greedy(load_model(path), prompt, 12) == mlx_lm_greedy(path, prompt, 12)


def test_interleaved_rope_is_refused_not_run_as_halves():
    """Older MLX conversions may say rope_traditional: true, which mlx-lm honours; cadence
    ignored it and rotated halves, every token off with no word."""
    with pytest.raises(CheckpointError, match="rope_traditional=true is not supported"):
        config_from_dict(llama_config(rope_traditional=True))
    assert config_from_dict(llama_config(rope_traditional=False)).head_dim


def test_a_tied_checkpoint_that_stores_a_quantized_head_too_loads_without_it(
    make_checkpoint, tmp_path
):
    """Tied, the head is the embedding: a stored quantized lm_head's scales and biases
    were left behind ("unexpected tensor 'lm_head.biases'") when its weight was dropped."""
    path = shutil.copytree(make_checkpoint("llama", quantize=(32, 4)), tmp_path / "ck")
    weights = dict(mx.load(str(path / "model.safetensors")))
    assert "lm_head.scales" in weights  # untied as made: the head is stored, quantized
    edit_config(path, tie_word_embeddings=True)
    loaded = load_model(path)
    assert "lm_head" not in loaded.model  # the head is the embedding, as config.json says


def test_eos_ids_are_listed_once_generation_configs_first():
    config = config_from_dict(llama_config(eos_token_id=[7, 2]), {"eos_token_id": [2, 3, 2]})
    assert config.eos_token_ids == (2, 3, 7)


def test_a_config_json_that_is_no_object_is_named(broken):
    (broken / "config.json").write_text("[1, 2]")
    assert "expected a JSON object" in error_for(broken)


def test_without_eos_ids_in_the_config_the_tokenizers_are_used(broken):
    edit_config(broken, eos_token_id=None)
    (broken / "generation_config.json").unlink()
    loaded = load_model(broken)
    assert loaded.config.eos_token_ids
    assert loaded.config.eos_token_ids == tuple(sorted(loaded.tokenizer.eos_token_ids))


def test_rotary_inv_freq_tensors_are_ignored(broken):
    weights = mx.load(str(broken / "model.safetensors"))
    inv_freq = {"model.layers.0.self_attn.rotary_emb.inv_freq": mx.ones((8,))}
    mx.save_safetensors(str(broken / "model.safetensors"), {**weights, **inv_freq})
    assert load_model(broken).config.num_hidden_layers == 2


def test_a_tied_checkpoint_that_also_stores_lm_head_loads(make_checkpoint, tmp_path):
    path = tmp_path / "tied"
    shutil.copytree(make_checkpoint("llama", tie_word_embeddings=True), path)
    weights = mx.load(str(path / "model.safetensors"))
    assert "lm_head.weight" not in weights
    head = {"lm_head.weight": weights["model.embed_tokens.weight"]}
    mx.save_safetensors(str(path / "model.safetensors"), {**weights, **head})
    tokens = mx.array([[5, 17, 99]])
    as_made = load_model(make_checkpoint("llama", tie_word_embeddings=True))
    assert mx.array_equal(load_model(path).model(tokens), as_made.model(tokens))


def test_a_gptq_checkpoint_is_refused_naming_its_quant_method(broken):
    """GPTQ/AWQ store `qweight`, `qzeros` and `scales` where a Linear's `weight` was."""
    weights = dict(mx.load(str(broken / "model.safetensors")))
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        out_features, in_features = weights.pop(name).shape
        prefix = name.removesuffix(".weight")
        weights[f"{prefix}.qweight"] = mx.zeros((in_features // 8, out_features), dtype=mx.int32)
        weights[f"{prefix}.qzeros"] = mx.zeros((1, out_features // 8), dtype=mx.int32)
        weights[f"{prefix}.scales"] = mx.ones((1, out_features), dtype=mx.float16)
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    edit_config(broken, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128})
    message = error_for(broken)
    assert "quantized with 'gptq'" in message and "quantization_config" in message


def test_a_stale_quantization_config_over_float_weights_still_loads(broken):
    edit_config(broken, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    assert load_model(broken).config.foreign_quantization == "bitsandbytes"


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        ({"quant_method": "awq"}, "awq"),
        ({"bits": 4}, "unknown"),  # no method named
        ({"quant_method": ""}, "unknown"),
        ({"quant_method": 4}, "unknown"),
    ],
    ids=["named", "missing", "empty", "not-text"],
)
def test_a_foreign_quantization_is_named_by_its_quant_method_or_as_unknown(
    quantization_config, named
):
    config = config_from_dict(llama_config(quantization_config=quantization_config))
    assert config.foreign_quantization == named
    with_mlx = llama_config(
        quantization_config=quantization_config, quantization={"group_size": 32, "bits": 4}
    )
    assert config_from_dict(with_mlx).foreign_quantization is None  # mlx-community writes both


def test_an_index_naming_a_missing_shard_is_named(broken):
    write_index(broken, {"model.norm.weight": "model-00002-of-00002.safetensors"})
    assert "names shard 'model-00002-of-00002.safetensors', which is missing" in error_for(broken)


def test_a_directory_without_weights_is_named(broken):
    (broken / "model.safetensors").unlink()
    assert "no *.safetensors weight files" in error_for(broken)


@pytest.mark.parametrize("name", ["a/b/c", "nobody"])
def test_a_name_that_is_no_path_and_no_repo_id_is_named(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="not a Hugging Face repo id"):
        resolve_checkpoint(name, offline=True)


def test_the_deepest_layer_count_allowed_is_accepted():
    assert config_from_dict(llama_config(num_hidden_layers=10_000)).num_hidden_layers == 10_000
    with pytest.raises(CheckpointError, match="10001, more than 10000"):
        config_from_dict(llama_config(num_hidden_layers=10_001))


def test_a_file_cut_short_by_a_few_bytes_names_the_tensor_past_its_end(broken):
    file = broken / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-4])
    header_len = int.from_bytes(data[:8], "little")
    data_len = len(data) - 8 - header_len
    message = error_for(broken)
    assert "truncated: tensor" in message
    assert f"ends at byte {data_len} of {data_len - 4}" in message


def test_a_header_longer_than_the_file_is_named_as_truncated(broken):
    header = json.dumps(entry()).encode()
    file = broken / "model.safetensors"
    # Its length says 4 bytes more than the file holds after it.
    file.write_bytes((len(header) + 4).to_bytes(8, "little") + header)
    message = error_for(broken)
    assert "model.safetensors: truncated (header runs past the end of the file)" in message
    file.write_bytes(len(header).to_bytes(8, "little") + header)  # exactly to the end: no data
    assert "truncated: tensor 'model.norm.weight' ends at byte 8 of 0" in error_for(broken)


def test_a_zero_size_tensor_is_a_valid_safetensors_entry(broken):
    """Shape [0] stored at [n, n] is what mlx (and safetensors) write for an empty tensor."""
    weights = mx.load(str(broken / "model.safetensors"))
    empty = {"model.layers.0.self_attn.rotary_emb.inv_freq": mx.zeros((0,))}
    mx.save_safetensors(str(broken / "model.safetensors"), {**weights, **empty})
    assert load_model(broken).config.num_hidden_layers == 2


@pytest.mark.parametrize("name", ["./nowhere", "~/nowhere", "/nowhere"])
def test_a_path_that_does_not_exist_is_never_looked_up_on_the_hub(tmp_path, monkeypatch, name):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))

    def snapshot_download(*args, **kwargs):
        raise AssertionError("a path was taken for a repo id")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(CheckpointError) as error:
        resolve_checkpoint(name)
    assert str(error.value) == f"{name}: no such directory, and not a Hugging Face repo id"


@pytest.mark.parametrize(
    ("offline", "env", "local_only", "where"),
    [
        (True, None, True, "in the local Hugging Face cache"),
        (False, "1", True, "locally or on the Hub"),
        (False, "0", False, "locally or on the Hub"),
        (False, None, False, "locally or on the Hub"),
    ],
    ids=["offline", "hf-hub-offline", "hf-hub-online", "online"],
)
def test_a_repo_id_is_fetched_unless_offline_and_a_miss_says_where_it_was_looked_for(
    monkeypatch, offline, env, local_only, where
):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    if env is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", env)
    asked = []

    def snapshot_download(repo_id, *, allow_patterns, ignore_patterns, local_files_only):
        asked.append(local_files_only)
        raise FileNotFoundError(repo_id)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(CheckpointError) as error:
        resolve_checkpoint("nobody/no-such-model", offline=offline)
    assert asked == [local_only]
    assert str(error.value) == f"nobody/no-such-model: not found {where} (FileNotFoundError)"


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("model.layers.0.self_attn.q_proj.weight", mx.int32), ("model.norm.weight", mx.bool_)],
    ids=["int-projection", "bool-norm"],
)
def test_an_integer_or_bool_tensor_where_the_model_computes_in_floats_is_named(broken, name, dtype):
    """It loaded, cast to numbers that mean nothing, and generated noise without a word."""
    weights = mx.load(str(broken / "model.safetensors"))
    weights[name] = weights[name].astype(dtype)
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    message = error_for(broken)
    assert f"tensor {name!r} has dtype {str(dtype).removeprefix('mlx.core.')}, expected floating-point" in message


@pytest.mark.parametrize("method", ["mxfp4", "mxfp8"])
def test_a_quantization_config_in_an_mlx_packing_is_read_as_its_quantization_not_foreign(method):
    """gpt-oss as OpenAI released it: a weight that then does not fit is named as such,
    not blamed on a packing cadence does load."""
    config = config_from_dict(llama_config(quantization_config={"quant_method": method}))
    assert config.quantization is not None and config.quantization.mode == method
    assert config.foreign_quantization is None


def read_safetensors(file):
    """(header, data) of a safetensors file."""
    raw = file.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + header_len]), raw[8 + header_len :]


def test_tensors_sharing_bytes_are_refused_not_loaded_as_each_others_weights(broken):
    """mlx reads each tensor at its offsets, whatever they share: one norm pointed at
    the other's bytes loaded as that norm's weights."""
    file = broken / "model.safetensors"
    header, data = read_safetensors(file)
    first, second = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
    header[second]["data_offsets"] = header[first]["data_offsets"]
    write_safetensors(file, header, data)
    message = error_for(broken)
    assert "model.safetensors: corrupt safetensors header: tensor" in message
    assert "(tensors overlapping or leaving a gap)" in message


def test_bytes_no_tensor_holds_are_refused_as_safetensors_does(broken):
    file = broken / "model.safetensors"
    header, data = read_safetensors(file)
    write_safetensors(file, header, data + b"\0" * 64)
    assert "64 bytes after the last tensor" in error_for(broken)


def test_a_shape_past_mlxs_int32_sizes_is_refused_not_cut_to_fit(broken):
    """mlx keeps a stored dimension's low 32 bits: lm_head declared 2**32 + 2048 rows
    read as its 2,048 and loaded."""
    file = broken / "model.safetensors"
    header, data = read_safetensors(file)
    rows, columns = header["lm_head.weight"]["shape"]
    header["lm_head.weight"]["shape"] = [2**32 + rows, columns]
    write_safetensors(file, header, data)
    assert "tensor 'lm_head.weight' has a dimension past 2147483647" in error_for(broken)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"format": 5}, "__metadata__ value 'format' is 5, not a string"),
        ({"format": "pt", "nested": {"b": 1}}, "__metadata__ value 'nested' is {\"b\": 1}, not a string"),
        (5, "__metadata__ is 5, not an object of strings"),
        (True, "__metadata__ is true, not an object of strings"),
        (["pt", 1], "__metadata__ is [\"pt\", 1], not an object of strings"),
    ],
)
def test_metadata_mlx_cannot_read_is_named_not_mlxs_json_error(broken, metadata, expected):
    """mlx failed these as "[json.exception.type_error.302] type must be string"."""
    file = broken / "model.safetensors"
    header, data = read_safetensors(file)
    write_safetensors(file, {**header, "__metadata__": metadata}, data)
    message = error_for(broken)
    assert f"model.safetensors: corrupt safetensors header: {expected}" in message
    assert "json.exception" not in message


@pytest.mark.parametrize("metadata", [None, {"format": "mlx"}, "free text", ["a", "b"]])
def test_metadata_mlx_reads_still_loads(broken, metadata):
    """The format's object of strings, mlx's own null, and the string and list of strings
    mlx also reads."""
    file = broken / "model.safetensors"
    header, data = read_safetensors(file)
    write_safetensors(file, {**header, "__metadata__": metadata}, data)
    assert load_model(broken).config.num_hidden_layers > 0


@pytest.mark.parametrize("link", ["loop", "dangling"])
@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "additional_chat_templates/tool_use.jinja",
        "model.safetensors.index.json",
    ],
)
def test_a_link_that_loops_or_dangles_is_named_not_read_as_an_absent_file(broken, name, link):
    """Followed by exists(), such a link read as no file at all: a tokenizer_config.json
    that loops loaded without its chat template and special tokens."""
    file = broken / name
    file.parent.mkdir(exist_ok=True)
    file.unlink(missing_ok=True)
    file.symlink_to(file.name if link == "loop" else "nowhere.json")
    reason = "Too many levels of symbolic links" if link == "loop" else "No such file or directory"
    assert f"{name}: unreadable ({reason})" in error_for(broken)


def test_a_header_length_past_safetensors_limit_is_refused_before_it_is_read(broken):
    """Read whole, a header length naming the rest of a large shard took that much memory
    (1.4 GB for a 1 GiB file) before it was found not to be JSON."""
    file = broken / "model.safetensors"
    size = 200_000_000
    with file.open("wb") as f:  # sparse: no disk, and all but its length zeros
        f.write((size - 8).to_bytes(8, "little"))
        f.truncate(size)
    message = error_for(broken)
    assert f"a header of {size - 8} bytes, more than safetensors' 100000000" in message


def test_the_tokenizers_eos_stops_a_reply_beside_the_configs(broken):
    """Early Llama 3 Instruct conversions name <|end_of_text|> in config.json and
    <|eot_id|> only as the tokenizer's eos_token; mlx-lm and vLLM stop at both, and a
    reply here ran past <|eot_id|> to max_tokens."""
    edit_config(broken, eos_token_id=0)
    (broken / "generation_config.json").unlink()
    loaded = load_model(broken)
    assert loaded.tokenizer.eos_token_ids and 0 not in loaded.tokenizer.eos_token_ids
    assert set(loaded.config.eos_token_ids) == {0, *loaded.tokenizer.eos_token_ids}
