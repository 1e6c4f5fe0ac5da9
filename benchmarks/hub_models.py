"""Tiny keras-hub backbones built from a config (no download), and inputs
in each one's own format: shared by `bench_hub.py`, `bench_zoo.py` and
the tests (`from benchmarks.hub_models import ...`).

`BACKBONES` maps each `keras_hub.models.*Backbone` class name to a builder
`build(hidden_dim=32, num_layers=2)`: 2 layers (or stages), hidden 32
(16 for a cheaper test), 2 heads, vocabulary `VOCAB`, sequences of
`SEQ` tokens; vision backbones take 32x32 images (larger where the
architecture needs it). `SKIPPED` names each class not built here with
the reason. `inputs_for(model, n, seed)` makes random inputs of a built
model's own format from its input specs: token ids within the vocabulary
and a padding mask of a random length (2 to `SEQ`) each, zero segment
ids, images in [0, 1), other float inputs standard normal.

The configs follow keras-hub's own backbone tests
(`keras_hub/src/models/<model>/<model>_backbone_test.py`) where a class
needs more than its sizes.
"""

import keras
import numpy as np

VOCAB = 100
SEQ = 16
HEADS = 2
IMAGE = (32, 32, 3)


def keras_hub():
    """The keras-hub module, or an ImportError saying how to install it."""
    try:
        import keras_hub as hub
    except ImportError as error:
        raise ImportError(
            "keras-hub is not installed: `pip install --no-deps keras-hub` "
            "plus absl-py regex rich kagglehub kagglesdk sentencepiece "
            "tokenizers (its tensorflow-text requirement would pull a "
            "second TensorFlow)."
        ) from error
    return hub


def _models():
    return keras_hub().models


def _encoder(name, **kwargs):
    # BERT-style encoders: (vocabulary_size, num_layers, num_heads,
    # hidden_dim, intermediate_dim) plus a few extras.
    def build(hidden_dim=32, num_layers=2):
        return getattr(_models(), name)(
            vocabulary_size=VOCAB,
            num_layers=num_layers,
            num_heads=HEADS,
            hidden_dim=hidden_dim,
            intermediate_dim=2 * hidden_dim,
            **kwargs,
        )

    return build


def _decoder(name, heads="num_query_heads", kv="num_key_value_heads", **kw):
    # Decoder LMs with grouped-query attention: 2 query heads sharing 1
    # key/value head, RMSNorm, gated MLP, rotary embeddings.
    def build(hidden_dim=32, num_layers=2):
        extra = {k: v(hidden_dim) if callable(v) else v for k, v in kw.items()}
        return getattr(_models(), name)(
            vocabulary_size=VOCAB,
            num_layers=num_layers,
            hidden_dim=hidden_dim,
            intermediate_dim=2 * hidden_dim,
            **{heads: HEADS, kv: 1},
            **extra,
        )

    return build


def _half(d):
    return d // HEADS


def _smollm(name):
    def build(hidden_dim=32, num_layers=2):
        return getattr(_models(), name)(
            vocabulary_size=VOCAB,
            hidden_dim=hidden_dim,
            intermediate_dim=2 * hidden_dim,
            num_layers=num_layers,
            num_attention_heads=HEADS,
            num_key_value_heads=1,
            attention_bias=False,
            attention_dropout=0.0,
            rope_layer_enabled_list=[True] * num_layers,
            layer_types=["attention"] * num_layers,
            mlp_bias=False,
            layer_norm_epsilon=1e-6,
            max_position_embeddings=SEQ,
            rope_theta=10000.0,
            partial_rotary_factor=1.0,
        )

    return build


def _t5gemma(name):
    def build(hidden_dim=32, num_layers=2):
        stack = dict(
            hidden_dim=hidden_dim,
            intermediate_dim=2 * hidden_dim,
            num_layers=num_layers,
            num_attention_heads=HEADS,
            num_key_value_heads=1,
            head_dim=_half(hidden_dim),
            layer_types=["full_attention"] * num_layers,
        )
        return getattr(_models(), name)(
            vocabulary_size=VOCAB,
            **{f"encoder_{k}": v for k, v in stack.items()},
            **{f"decoder_{k}": v for k, v in stack.items()},
        )

    return build


def _vit(hidden_dim=32, num_layers=2):
    return _models().ViTBackbone(
        image_shape=IMAGE,
        patch_size=8,
        num_layers=num_layers,
        num_heads=HEADS,
        hidden_dim=hidden_dim,
        mlp_dim=2 * hidden_dim,
    )


def _resnet(hidden_dim=32, num_layers=2, image_shape=IMAGE):
    # keras-hub's ResNet needs 64 filters in its first stage (and so in the
    # stem, for the basic block's identity shortcut).
    return _models().ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[7],
        stackwise_num_filters=[64, 128][:num_layers],
        stackwise_num_blocks=[2] * num_layers,
        stackwise_num_strides=[1, 2][:num_layers],
        block_type="basic_block",
        image_shape=image_shape,
    )


def _mit(hidden_dim=32, num_layers=2):
    return _models().MiTBackbone(
        layerwise_depths=[2, 2],
        image_shape=IMAGE,
        hidden_dims=[hidden_dim // 2, hidden_dim],
        num_layers=2,
        layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[4, 2],
        max_drop_path_rate=0.0,
        layerwise_patch_sizes=[7, 3],
        layerwise_strides=[4, 2],
    )


def _dinov2(hidden_dim=32, num_layers=2, image_shape=(56, 56, 3), **kwargs):
    return _models().DINOV2Backbone(
        patch_size=14,
        num_layers=num_layers,
        hidden_dim=hidden_dim,
        num_heads=HEADS,
        intermediate_dim=2 * hidden_dim,
        image_shape=image_shape,
        position_embedding_shape=image_shape,
        **kwargs,
    )


def _clip_like(prefix, module):
    # A vision and a text encoder (keras-hub's CLIP, SigLIP and MetaCLIP 2
    # take the same positional sizes: patch size, hidden, layers, heads,
    # MLP; vocabulary, embedding, hidden, layers, heads, MLP).
    def build(hidden_dim=32, num_layers=2):
        import importlib

        def part(kind):
            path = f"keras_hub.src.models.{module}.{module}_{kind}_encoder"
            name = f"{prefix}{kind.capitalize()}Encoder"
            return getattr(importlib.import_module(path), name)

        vision = part("vision")(
            8, hidden_dim, num_layers, HEADS, 2 * hidden_dim, image_shape=IMAGE
        )
        text = part("text")(
            VOCAB,
            hidden_dim,
            hidden_dim,
            num_layers,
            HEADS,
            2 * hidden_dim,
            max_sequence_length=SEQ,
        )
        kwargs = {} if prefix == "SigLIP" else {"projection_dim": hidden_dim}
        return getattr(_models(), f"{prefix}Backbone")(
            vision_encoder=vision, text_encoder=text, **kwargs
        )

    return build


def _call(name, **fixed):
    """A builder of class `name` from fixed keyword arguments, some of them
    functions of `(hidden_dim, num_layers)`."""

    def build(hidden_dim=32, num_layers=2):
        kwargs = {
            k: v(hidden_dim, num_layers) if callable(v) else v
            for k, v in fixed.items()
        }
        return getattr(_models(), name)(**kwargs)

    return build


def _d(h, n):
    return h


def _d2(h, n):
    return 2 * h


def _n(h, n):
    return n


BACKBONES = {
    "AlbertBackbone": _call(
        "AlbertBackbone",
        vocabulary_size=VOCAB,
        num_layers=_n,
        num_heads=HEADS,
        embedding_dim=16,
        hidden_dim=_d,
        intermediate_dim=_d2,
        max_sequence_length=SEQ,
    ),
    "BartBackbone": _encoder("BartBackbone", max_sequence_length=SEQ),
    "BertBackbone": _encoder("BertBackbone", max_sequence_length=SEQ),
    "BloomBackbone": _encoder("BloomBackbone"),
    "DebertaV3Backbone": _encoder(
        "DebertaV3Backbone",
        max_sequence_length=SEQ,
        bucket_size=SEQ // 2,
        dropout=0.0,
    ),
    "DistilBertBackbone": _encoder(
        "DistilBertBackbone", max_sequence_length=SEQ
    ),
    "ElectraBackbone": _call(
        "ElectraBackbone",
        vocab_size=VOCAB,
        num_layers=_n,
        num_heads=HEADS,
        hidden_dim=_d,
        embedding_dim=16,
        intermediate_dim=_d2,
        max_sequence_length=SEQ,
    ),
    "ESMBackbone": _encoder("ESMBackbone", max_sequence_length=SEQ),
    "ESM2Backbone": _encoder("ESM2Backbone", max_sequence_length=SEQ),
    "FNetBackbone": _call(
        "FNetBackbone",
        vocabulary_size=VOCAB,
        num_layers=_n,
        hidden_dim=_d,
        intermediate_dim=_d2,
        max_sequence_length=SEQ,
    ),
    "FalconBackbone": _call(
        "FalconBackbone",
        vocabulary_size=VOCAB,
        num_layers=_n,
        num_attention_heads=HEADS,
        hidden_dim=_d,
        intermediate_dim=_d2,
    ),
    "GPT2Backbone": _encoder("GPT2Backbone", max_sequence_length=SEQ),
    "GPTNeoXBackbone": _encoder("GPTNeoXBackbone", max_sequence_length=SEQ),
    "OPTBackbone": _encoder("OPTBackbone", max_sequence_length=SEQ),
    "RobertaBackbone": _encoder("RobertaBackbone", max_sequence_length=SEQ),
    "RoformerV2Backbone": _encoder("RoformerV2Backbone", head_size=16),
    "XLMRobertaBackbone": _encoder(
        "XLMRobertaBackbone", max_sequence_length=SEQ
    ),
    "XLNetBackbone": _encoder("XLNetBackbone"),
    "GemmaBackbone": _decoder("GemmaBackbone", head_dim=_half),
    "Gemma3Backbone": _decoder(
        "Gemma3Backbone", head_dim=_half, image_size=16, vision_encoder=None
    ),
    "GptOssBackbone": _decoder("GptOssBackbone", num_experts=2, head_dim=_half),
    "LlamaBackbone": _decoder("LlamaBackbone"),
    "Llama3Backbone": _decoder("Llama3Backbone"),
    "MistralBackbone": _decoder("MistralBackbone"),
    "MixtralBackbone": _decoder("MixtralBackbone", num_experts=2),
    "PaliGemmaBackbone": _decoder(
        "PaliGemmaBackbone",
        head_dim=_half,
        image_size=16,
        vit_patch_size=4,
        vit_num_layers=2,
        vit_num_heads=HEADS,
        vit_hidden_dim=16,
        vit_intermediate_dim=32,
    ),
    "Phi3Backbone": _decoder("Phi3Backbone"),
    "QwenBackbone": _decoder("QwenBackbone"),
    "Qwen2Backbone": _decoder("Qwen2Backbone"),
    "Qwen3Backbone": _decoder("Qwen3Backbone", head_dim=_half),
    "QwenMoeBackbone": _decoder(
        "QwenMoeBackbone",
        moe_intermediate_dim=_half,
        shared_expert_intermediate_dim=_half,
        num_experts=4,
        top_k=2,
    ),
    "Qwen3MoeBackbone": _decoder(
        "Qwen3MoeBackbone",
        head_dim=_half,
        moe_intermediate_dim=_half,
        num_experts=4,
        top_k=2,
    ),
    # Its full-attention layers only (the default mixes in gated delta-net
    # linear attention, a recurrence of its own).
    "Qwen3_5Backbone": lambda hidden_dim=32, num_layers=2: _decoder(
        "Qwen3_5Backbone",
        head_dim=_half,
        layer_types=["full_attention"] * num_layers,
    )(hidden_dim, num_layers),
    "Qwen3_5MoeBackbone": lambda hidden_dim=32, num_layers=2: (
        _models().Qwen3_5MoeBackbone(
            vocabulary_size=VOCAB,
            num_layers=num_layers,
            num_query_heads=HEADS,
            num_key_value_heads=1,
            head_dim=_half(hidden_dim),
            hidden_dim=hidden_dim,
            moe_intermediate_dim=_half(hidden_dim),
            shared_expert_intermediate_size=_half(hidden_dim),
            num_experts=4,
            top_k=2,
            layer_types=["full_attention"] * num_layers,
        )
    ),
    "SmolLMBackbone": _smollm("SmolLMBackbone"),
    "SmolLM3Backbone": _smollm("SmolLM3Backbone"),
    "T5Backbone": _encoder("T5Backbone", key_value_dim=16, dropout=0.0),
    "T5GemmaBackbone": _t5gemma("T5GemmaBackbone"),
    "T5Gemma2Backbone": _t5gemma("T5Gemma2Backbone"),
    "EdRecBackbone": _call(
        "EdRecBackbone",
        vocab_size=VOCAB,
        num_layers_enc=_n,
        num_layers_dec=_n,
        hidden_dim=_d,
        intermediate_dim=_d2,
        num_heads=HEADS,
    ),
    "WhisperBackbone": _encoder(
        "WhisperBackbone",
        max_encoder_sequence_length=2 * SEQ,
        max_decoder_sequence_length=SEQ,
    ),
    "MoonshineBackbone": _call(
        "MoonshineBackbone",
        vocabulary_size=VOCAB,
        filter_dim=_d,
        encoder_num_layers=_n,
        decoder_num_layers=_n,
        hidden_dim=_d,
        intermediate_dim=_d2,
        encoder_num_heads=HEADS,
        decoder_num_heads=HEADS,
        max_position_embeddings=64,
    ),
    "RWKV7Backbone": _call(
        "RWKV7Backbone",
        hidden_size=_d,
        head_size=16,
        num_layers=_n,
        vocabulary_size=VOCAB,
        intermediate_dim=_d2,
        gate_lora=16,
        mv_lora=16,
        aaa_lora=16,
        decay_lora=16,
    ),
    "ViTBackbone": _vit,
    "DeiTBackbone": _call(
        "DeiTBackbone",
        image_shape=IMAGE,
        patch_size=8,
        num_layers=_n,
        num_heads=HEADS,
        hidden_dim=_d,
        intermediate_dim=_d2,
    ),
    "DINOV2Backbone": _dinov2,
    "DINOV3Backbone": _call(
        "DINOV3Backbone",
        patch_size=8,
        num_layers=_n,
        hidden_dim=_d,
        num_heads=HEADS,
        intermediate_dim=_d2,
        image_shape=IMAGE,
    ),
    "SwinTransformerBackbone": _call(
        "SwinTransformerBackbone",
        image_shape=IMAGE,
        embed_dim=_d,
        depths=(2, 2),
        num_heads=(2, 4),
        window_size=4,
        drop_path=0.0,
    ),
    "ViTDetBackbone": _call(
        "ViTDetBackbone",
        image_shape=IMAGE,
        patch_size=4,
        hidden_size=_d,
        num_layers=_n,
        global_attention_layer_indices=[1],
        intermediate_dim=_d2,
        num_heads=HEADS,
        num_output_channels=16,
        window_size=4,
    ),
    "MiTBackbone": _mit,
    "VideoPrismBackbone": _call(
        "VideoPrismBackbone",
        image_shape=(16, 16, 3),
        num_frames=2,
        patch_size=4,
        hidden_dim=_d,
        intermediate_dim=_d2,
        num_heads=HEADS,
        num_spatial_layers=1,
        num_temporal_layers=1,
        num_auxiliary_layers=1,
    ),
    "CLIPBackbone": _clip_like("CLIP", "clip"),
    "SigLIPBackbone": _clip_like("SigLIP", "siglip"),
    "MetaCLIP2Backbone": _clip_like("MetaCLIP2", "metaclip_2"),
    "ResNetBackbone": _resnet,
    "CSPNetBackbone": _call(
        "CSPNetBackbone",
        stem_filters=16,
        stem_kernel_size=3,
        stem_strides=1,
        stackwise_strides=2,
        stackwise_depth=[1, 2],
        stackwise_num_filters=[16, 32],
        image_shape=IMAGE,
        down_growth=True,
        bottle_ratio=(0.5, 1.0),
        block_ratio=(1.0, 0.5),
        expand_ratio=(2.0, 1.0),
        block_type="dark_block",
        stage_type="csp",
        stem_padding="same",
    ),
    "DenseNetBackbone": _call(
        "DenseNetBackbone",
        stackwise_num_repeats=[2, 2],
        image_shape=IMAGE,
        growth_rate=8,
    ),
    "EfficientNetBackbone": _call(
        "EfficientNetBackbone",
        stackwise_kernel_sizes=[3, 3],
        stackwise_num_repeats=[1, 2],
        stackwise_input_filters=[16, 16],
        stackwise_output_filters=[16, 32],
        stackwise_expansion_ratios=[1, 4],
        stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
        stackwise_strides=[1, 2],
        stackwise_block_types=["fused", "unfused"],
        stackwise_force_input_filters=[0, 0],
        stackwise_nores_option=[False, False],
        width_coefficient=1.0,
        depth_coefficient=1.0,
        input_shape=IMAGE,
    ),
    "HGNetV2Backbone": _call(
        "HGNetV2Backbone",
        embedding_size=32,
        stem_channels=[3, 16, 32],
        hidden_act="relu",
        use_learnable_affine_block=False,
        image_shape=IMAGE,
        depths=[1, 1],
        hidden_sizes=[64, 128],
        stackwise_stage_filters=[[32, 16, 64, 1, 1, 3], [64, 32, 128, 1, 1, 3]],
        apply_downsample=[False, True],
        use_lightweight_conv_block=[False, False],
    ),
    "MobileNetBackbone": _call(
        "MobileNetBackbone",
        stackwise_expansion=[[40, 56], [64, 144]],
        stackwise_num_blocks=[2, 2],
        stackwise_num_filters=[[16, 16], [24, 24]],
        stackwise_kernel_size=[[3, 3], [5, 5]],
        stackwise_num_strides=[[2, 1], [2, 1]],
        stackwise_se_ratio=[[None, None], [0.25, 0.25]],
        stackwise_activation=[
            ["relu", "relu"],
            ["hard_swish", "hard_swish"],
            ["hard_swish"],
        ],
        stackwise_padding=[[1, 1], [2, 2]],
        output_num_filters=64,
        image_shape=IMAGE,
        depthwise_filters=8,
        depthwise_stride=2,
        depthwise_residual=False,
        squeeze_and_excite=0.5,
        last_layer_filter=96,
    ),
    "MobileNetV5Backbone": _call(
        "MobileNetV5Backbone",
        stackwise_block_types=[["er"], ["uir", "uir"]],
        stackwise_num_blocks=[1, 2],
        stackwise_num_filters=[[24], [48, 48]],
        stackwise_strides=[[2], [2, 1]],
        stackwise_act_layers=[["relu"], ["relu", "relu"]],
        stackwise_exp_ratios=[[4.0], [6.0, 6.0]],
        stackwise_se_ratios=[[0.0], [0.0, 0.0]],
        stackwise_dw_kernel_sizes=[[0], [5, 5]],
        stackwise_dw_start_kernel_sizes=[[0], [0, 0]],
        stackwise_dw_end_kernel_sizes=[[0], [0, 0]],
        stackwise_exp_kernel_sizes=[[3], [0, 0]],
        stackwise_pw_kernel_sizes=[[1], [0, 0]],
        stackwise_num_heads=[[0], [0, 0]],
        stackwise_key_dims=[[0], [0, 0]],
        stackwise_value_dims=[[0], [0, 0]],
        stackwise_kv_strides=[[0], [0, 0]],
        stackwise_use_cpe=[[False], [False, False]],
        image_shape=IMAGE,
        stem_size=16,
        use_msfa=False,
    ),
    "VGGBackbone": _call(
        "VGGBackbone",
        stackwise_num_repeats=[1, 1],
        stackwise_num_filters=[16, 32],
        image_shape=IMAGE,
    ),
    "XceptionBackbone": _call(
        "XceptionBackbone",
        stackwise_conv_filters=[[16, 32], [64, 64]],
        stackwise_pooling=[False, True],
        image_shape=(64, 64, 3),
    ),
    "DeepLabV3Backbone": lambda hidden_dim=32, num_layers=2: (
        _models().DeepLabV3Backbone(
            image_encoder=_models().ResNetBackbone(
                input_conv_filters=[64],
                input_conv_kernel_sizes=[7],
                stackwise_num_filters=[64, 64, 64],
                stackwise_num_blocks=[1, 1, 1],
                stackwise_num_strides=[1, 2, 2],
                block_type="basic_block",
            ),
            low_level_feature_key="P2",
            spatial_pyramid_pooling_key="P4",
            dilation_rates=[6, 12, 18],
            upsampling_size=4,
            image_shape=(64, 64, 3),
            projection_filters=16,
        )
    ),
    "RetinaNetBackbone": lambda hidden_dim=32, num_layers=2: (
        _models().RetinaNetBackbone(
            image_encoder=_models().ResNetBackbone(
                input_conv_filters=[64],
                input_conv_kernel_sizes=[7],
                stackwise_num_filters=[64, 64, 64, 64],
                stackwise_num_blocks=[1, 1, 1, 1],
                stackwise_num_strides=[1, 2, 2, 2],
                block_type="basic_block",
            ),
            min_level=3,
            max_level=5,
            use_p5=True,
            image_shape=(64, 64, 3),
        )
    ),
    "SegFormerBackbone": lambda hidden_dim=32, num_layers=2: (
        _models().SegFormerBackbone(
            image_encoder=_mit(hidden_dim), projection_filters=16
        )
    ),
    "DepthAnythingBackbone": lambda hidden_dim=32, num_layers=4: (
        _models().DepthAnythingBackbone(
            image_encoder=_dinov2(
                hidden_dim,
                4,
                image_shape=(126, 126, 3),
                apply_layernorm=True,
                name="image_encoder",
            ),
            reassemble_factors=[4, 2, 1, 0.5],
            neck_hidden_dims=[16, 16, 16, 16],
            fusion_hidden_dim=16,
            head_hidden_dim=16,
            head_in_index=-1,
            feature_keys=["stage1", "stage2", "stage3", "stage4"],
        )
    ),
    "PARSeqBackbone": lambda hidden_dim=32, num_layers=2: (
        _models().PARSeqBackbone(
            image_encoder=_models().ViTBackbone(
                image_shape=(32, 64, 3),
                patch_size=(8, 8),
                num_layers=num_layers,
                num_heads=HEADS,
                hidden_dim=hidden_dim,
                mlp_dim=2 * hidden_dim,
                use_class_token=False,
                name="image_encoder",
            ),
            vocabulary_size=VOCAB,
            max_label_length=SEQ,
            decoder_hidden_dim=hidden_dim,
            num_decoder_layers=1,
            num_decoder_heads=HEADS,
            decoder_mlp_dim=2 * hidden_dim,
            dropout_rate=0.0,
            attention_dropout=0.0,
        )
    ),
}

# Classes not built here, with the reason.
SKIPPED = {
    "BASNetBackbone": (
        "too large: its prediction and refinement modules have fixed "
        "512-filter convolutions (`projection_filters * 8`, and the encoder's "
        "64-filter blocks need `projection_filters=64`): 50.6M parameters "
        "with a 1-block-per-stage ResNet encoder at 64x64 (measured)"
    ),
    "FeaturePyramidBackbone": (
        "abstract base class (no layers of its own; ResNet, CSPNet, ... "
        "derive from it)"
    ),
    "StableDiffusion3Backbone": (
        "composite of an MMDiT, a VAE and two CLIP text encoders with a "
        "scheduler loop: a pipeline, not one graph to export"
    ),
    "FluxBackbone": (
        "composite of a transformer, a VAE and CLIP/T5 text encoders with "
        "a scheduler loop: a pipeline, not one graph to export"
    ),
    "SAMBackbone": (
        "composite (ViTDet image encoder, prompt encoder, mask decoder) "
        "with optional prompt inputs (points, boxes, masks): not built here"
    ),
    "SAM3PromptableConceptBackbone": (
        "composite of six sub-models (vision, text, geometry encoders, "
        "DETR encoder and decoder, mask decoder): not built here"
    ),
    "BLIP2Backbone": (
        "composite of a vision encoder, a Q-Former and a custom OPT: not "
        "built here"
    ),
    "DFineBackbone": (
        "detection transformer with denoising queries and deformable "
        "attention (25 required arguments, an HGNetV2 backbone): not "
        "built here"
    ),
    "Gemma3nBackbone": (
        "AltUp / Laurel / per-layer-input text stack plus optional audio "
        "and MobileNetV5 vision encoders (17 required arguments): not "
        "built here"
    ),
    "Gemma4Backbone": (
        "text stack with optional vision and audio encoders of its own: not "
        "built here"
    ),
}


def attention_classes(model):
    """The class names of the layers of `model` that compute attention
    (a name containing "Attention", a Keras `MultiHeadAttention`), sorted;
    a twin counts as its float class."""
    from keras_mp import _models

    names = set()
    for layer in _models.walk_layers(model):
        cls = getattr(type(layer), "float_class", None) or type(layer)
        if "Attention" in cls.__name__ or isinstance(
            layer, keras.layers.MultiHeadAttention
        ):
            names.add(cls.__name__)
    nested = {n for n in names if n.endswith("AttentionEncoder")}
    return sorted(names - nested) if names - nested else sorted(names)


def _length_mask(rng, n, length):
    lengths = rng.integers(min(2, length), length + 1, n)[:, None]
    return (np.arange(length)[None] < lengths).astype("int32")


def inputs_for(model, n, seed=0, seq=SEQ):
    """`n` random inputs for built keras-hub `model`, in its own format (a
    dict by input name for a dict-input model, else an array).

    Token ids are in [1, vocabulary) and zero past a random length (2 to
    `seq`) per row, with the padding masks to match (one length per
    `encoder_` / `decoder_` prefix); segment ids are zero; float inputs of
    rank 4 or more are images in [0, 1), the others standard normal.
    Dimensions left None take `seq` (2 * `seq` for a feature encoder's
    float sequence, 128 * `seq` samples of raw audio, and the padding mask
    of the same `encoder_` / `decoder_` prefix its length).
    """
    rng = np.random.default_rng(seed)
    vocab = int(
        getattr(model, "vocabulary_size", None)
        or getattr(model, "vocab_size", None)
        or VOCAB
    )
    struct = getattr(model, "_inputs_struct", None)
    specs = (
        dict(struct)
        if isinstance(struct, dict)
        else {t.name: t for t in model.inputs}
    )
    masks = {}
    times = {}  # the length of a float sequence input, by prefix
    out = {}
    for name in sorted(
        sorted(specs), key=lambda k: "float" not in str(specs[k].dtype)
    ):
        tensor = specs[name]
        floating = "float" in str(tensor.dtype)
        prefix = name.split("_")[0]
        prefix = prefix if prefix in ("encoder", "decoder") else ""
        fill = times.get(prefix, seq)
        if floating and len(tensor.shape) == 3:  # features, or raw audio
            fill = 128 * seq if tensor.shape[-1] == 1 else 2 * seq
            times[prefix] = fill  # its padding mask's length
        shape = [n] + [d or fill for d in tensor.shape[1:]]
        if floating:
            out[name] = (
                rng.random(shape, "float32")
                if len(shape) >= 4
                else rng.standard_normal(shape).astype("float32")
            )
            continue
        key = (prefix, shape[1] if len(shape) > 1 else 0)
        if key not in masks and len(shape) == 2:
            masks[key] = _length_mask(rng, n, shape[1])
        mask = masks.get(key)
        if "mask" in name:
            out[name] = mask.astype(tensor.dtype)
        elif "token" in name or name.endswith("ids") and "segment" not in name:
            ids = rng.integers(1, vocab, shape)
            out[name] = (ids * mask if mask is not None else ids).astype(
                tensor.dtype
            )
        else:
            out[name] = np.zeros(shape, tensor.dtype)
    if isinstance(struct, dict):
        return out
    values = [out[t.name] for t in model.inputs]
    return values[0] if len(values) == 1 else values
