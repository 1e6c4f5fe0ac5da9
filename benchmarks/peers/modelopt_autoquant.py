"""Peer benchmark: NVIDIA ModelOpt AutoQuantize (per-layer format search).

ModelOpt's AutoQuantize (`modelopt.torch.quantization.auto_quantize`) is
PyTorch only, so this runs in the ModelOpt venv, on a float ONNX exported
by keras_mp (`export_for_modelopt.py` writes the models and `data.npz`):

1. the ONNX becomes a torch `fx.GraphModule` with `onnx2torch`; every
   MatMul by a constant 2-D weight (Keras `Dense`, `EinsumDense`) is then
   rewritten into an `nn.Linear` (with the following constant bias Add
   folded in), since ModelOpt only quantizes `nn.Linear` / `nn.ConvNd`
   and onnx2torch leaves such a MatMul a generic module. The converted
   module is checked against ONNX Runtime (CPU) on the evaluation images;
2. FP8 fake quantization on CPU is probed: a ModelOpt E4M3 quantizer
   against torch's own `float8_e4m3fn` cast of the same scaled tensor;
3. `mtq.auto_quantize` searches INT8 (`mtq.INT8_DEFAULT_CFG`) and FP8
   (`mtq.FP8_DEFAULT_CFG`) per layer, with the gradient searcher
   (`method="gradient"`, cross-entropy on the labels), on the calibration
   images in batches of `--batch`, under the first `--effective-bits`
   target. ModelOpt counts effective bits over the weights against a
   16-bit baseline: a layer left unquantized costs 16, INT8 and FP8 cost 8
   each, so with these two formats a target below 8 is infeasible (its
   error is recorded as is) and 8.0 forces every searched layer into one
   of the two formats. Each further target is re-solved from the same
   scores (`mtq.get_auto_quantize_config`) and quantized again on a fresh
   copy (`mtq.quantize`, max calibration on the calibration images).
   Q, K and V of a Keras MultiHeadAttention share one format
   (`KERAS_QKV_RULE`, ModelOpt's own q/k/v rule for Keras names; off with
   `--no-qkv-group`). The attention matmuls themselves (Q x K^T,
   softmax x V: two run-time tensors) are not searched nor quantized:
   ModelOpt quantizes only `nn.Linear` / `nn.ConvNd` here (they are listed
   as `matmuls_left_unquantized`);
4. top-1 of the float module and of each fake-quant module on the
   evaluation images.

Forward and backward passes are counted by wrapping the `forward_step`
and `forward_backward_step` given to ModelOpt (ModelOpt reports neither);
during scoring ModelOpt also reruns every searched module once per format
inside the forward pass (not counted as model passes).

A step that fails is a result: its error text goes in `errors` and the
remaining steps that do not depend on it still run.

    <modelopt venv>/bin/python benchmarks/peers/modelopt_autoquant.py
        --onnx DIR/reference_cnn.onnx --data DIR/data.npz --out out.json
        [--effective-bits 8.0 12.0] [--batch 64] [--threads 2]
    python benchmarks/peers/modelopt_autoquant.py --setup-venv VENV

The JSON is written to a temporary file, then renamed. Environment:
`torch==2.13.0` (the local CPU build first, or pip pulls a CUDA torch),
`nvidia-modelopt[onnx]`, then `requests` and `huggingface_hub` (modelopt
0.47 imports both at `import modelopt.torch` without declaring them) and
`onnx2torch` with `--no-deps` (its torchvision requirement pulls a CUDA
torch and a torchvision whose extension cannot load on a CPU torch;
onnx2torch only needs torchvision for NMS / RoIAlign, stubbed here);
`SETUP` below.
"""

import argparse
import copy
import json
import os
import sys
import time
import traceback
import types

import numpy as np

# ModelOpt's progress bars (tqdm) would fill the log.
os.environ.setdefault("TQDM_DISABLE", "1")

SETUP = [
    ["pip", "install", "--upgrade", "pip"],
    ["pip", "install", "torch==2.13.0"],
    ["pip", "install", "nvidia-modelopt[onnx]==0.47.0"],
    ["pip", "install", "requests", "huggingface_hub"],
    ["pip", "install", "--no-deps", "onnx2torch==1.5.15"],
]
FORMATS = ("int8", "fp8")
# ModelOpt's own rule r"^(.*?)\.(q_proj|k_proj|v_proj)$" gives Q, K and V of
# one attention layer one format (TensorRT-LLM fuses them); the same rule
# for Keras MultiHeadAttention's names as onnx2torch spells them.
KERAS_QKV_RULE = r"^(.*?/mha_1)/(query_1|key_1|value_1)/MatMul$"
# A parity tolerance for the onnx2torch conversion: float32 both sides,
# so only summation order differs.
CONVERSION_TOL = 1e-3


# What AutoQuantize needs beyond bench_peers.py's ModelOpt venv (whose
# SETUP is the first three steps): a venv made there is completed in place.
EXTRAS = SETUP[3:]


def setup_venv(path):
    """Creates the ModelOpt venv at `path` with `SETUP`, or, when it
    exists without them (bench_peers.py's), installs `EXTRAS` into it."""
    import subprocess

    python = os.path.join(path, "bin", "python")
    steps = SETUP
    if os.path.exists(python):
        # Found, not imported: onnx2torch's import needs torchvision.
        probe = (
            "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is "
            "None for m in ('onnx2torch', 'requests', 'huggingface_hub')))"
        )
        if subprocess.run([python, "-c", probe]).returncode == 0:
            log(f"{path} has what AutoQuantize needs; not reinstalling")
            return
        steps = EXTRAS
    else:
        log(f"creating {path}")
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
    for step in steps:
        log("  " + " ".join(step))
        subprocess.run([python, "-m"] + step, check=True)


def log(msg):
    print(f"[modelopt_autoquant {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def error_text(e):
    return f"{type(e).__name__}: {e}"


def stub_torchvision():
    """onnx2torch imports torchvision for its NMS and RoIAlign converters
    only; without a working torchvision, a stub lets it import (those two
    ops then raise)."""
    try:
        import torchvision  # noqa: F401

        return None
    except Exception as e:  # missing, or a CUDA build on a CPU torch
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        reason = error_text(e)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"torchvision unavailable ({reason})")

    tv = types.ModuleType("torchvision")
    ops = types.ModuleType("torchvision.ops")
    ops.nms = ops.roi_align = ops.batched_nms = missing
    tv.ops = ops
    sys.modules["torchvision"] = tv
    sys.modules["torchvision.ops"] = ops
    return f"torchvision stubbed for onnx2torch: {reason}"


def versions():
    import importlib.metadata as md

    out = {}
    for p in ("nvidia-modelopt", "torch", "onnx2torch", "onnx", "onnxruntime"):
        for name in (p, p + "-gpu") if p == "onnxruntime" else (p,):
            try:
                out[name] = md.version(name)
            except md.PackageNotFoundError:
                pass
    return out


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def matmul_to_linear(gm):
    """Rewrites `x @ W` (W a constant 2-D tensor) into `nn.Linear`, folding
    a following `+ b` (b a constant 1-D tensor) into its bias.

    Returns:
        list of the rewritten modules' names.
    """
    import torch
    from onnx2torch.node_converters.binary_math_operations import (
        OnnxBinaryMathOperation,
    )
    from onnx2torch.node_converters.matmul import OnnxMatMul

    def constant(node):
        if node.op != "get_attr":
            return None
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        return value

    rewritten = []
    modules = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        if not isinstance(modules.get(node.target), OnnxMatMul):
            continue
        weight = constant(node.args[1])
        if weight is None or weight.dim() != 2:
            continue
        linear = torch.nn.Linear(weight.shape[0], weight.shape[1], bias=True)
        with torch.no_grad():
            linear.weight.copy_(weight.T)
            linear.bias.zero_()
        users = list(node.users)
        if len(users) == 1 and users[0].op == "call_module":
            add = users[0]
            mod = modules.get(add.target)
            other = [a for a in add.args if a is not node]
            bias = constant(other[0]) if len(other) == 1 else None
            if (
                isinstance(mod, OnnxBinaryMathOperation)
                and mod.math_op_function is torch.add
                and mod.broadcast is None
                and bias is not None
                and bias.dim() == 1
                and bias.shape[0] == weight.shape[1]
            ):
                with torch.no_grad():
                    linear.bias.copy_(bias)
                add.replace_all_uses_with(node)
                gm.graph.erase_node(add)
        gm._modules[node.target] = linear
        node.args = (node.args[0],)
        rewritten.append(node.target)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return rewritten


def convert(onnx_path):
    """The float ONNX as a torch module (onnx2torch), MatMuls as Linear."""
    import onnx
    import onnx2torch
    import torch

    gm = onnx2torch.convert(onnx.load(onnx_path))
    linears = matmul_to_linear(gm)
    kinds = {}
    for _, m in gm.named_modules():
        kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    weighted = sum(
        isinstance(m, torch.nn.Linear | torch.nn.modules.conv._ConvNd)
        for m in gm.modules()
    )
    # What ModelOpt cannot quantize here: a MatMul of two run-time tensors
    # (attention Q x K^T and softmax x V) stays a generic onnx2torch module;
    # ModelOpt quantizes attention BMMs only inside the Hugging Face
    # attention classes it patches.
    left = [
        n for n, m in gm.named_modules() if type(m).__name__ == "OnnxMatMul"
    ]
    return gm.eval(), {
        "matmul_to_linear": linears,
        "matmuls_left_unquantized": left,
        "weighted_modules": weighted,
        "module_types": dict(sorted(kinds.items())),
    }


def batches(x, y, batch):
    import torch

    return [
        (torch.from_numpy(x[i : i + batch]), torch.from_numpy(y[i : i + batch]))
        for i in range(0, len(x), batch)
    ]


def logits_of(model, x, batch=250):
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(x), batch):
            out.append(model(torch.from_numpy(x[i : i + batch])).numpy())
    return np.concatenate(out)


def top1(logits, y):
    return round(100.0 * float(np.mean(np.argmax(logits, -1) == y)), 2)


def time_phases():
    """Times ModelOpt's loops over the data (each calibration, the scoring)
    by wrapping the searchers' `_run_func` (private in 0.47; None when it is
    gone). Returns the dict the times go into, by ModelOpt's description."""
    from modelopt.torch.quantization import algorithms

    base = getattr(algorithms, "_AutoQuantizeBaseSearcher", None)
    original = getattr(base, "_run_func", None)
    if original is None:
        return None
    phases = {}

    def timed(self, func, num_iters=1, desc=""):
        start = time.perf_counter()
        try:
            return original(self, func, num_iters=num_iters, desc=desc)
        finally:
            seconds = time.perf_counter() - start
            phases[desc] = round(phases.get(desc, 0.0) + seconds, 1)

    base._run_func = timed
    return phases


def agreement(logits, reference):
    """Per-image top-1 agreement in percent (None without a reference)."""
    if reference is None:
        return None
    same = np.argmax(logits, -1) == np.argmax(reference, -1)
    return round(100.0 * float(np.mean(same)), 2)


def ort_logits(onnx_path, x, batch=250):
    import onnxruntime as ort

    sess = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return np.concatenate(
        [
            sess.run(None, {name: x[i : i + batch]})[0]
            for i in range(0, len(x), batch)
        ]
    )


def fp8_probe():
    """ModelOpt's E4M3 fake quant on CPU against torch's float8_e4m3fn."""
    import torch
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    amax = float(x.abs().max())
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
    q.amax = torch.tensor(amax)
    got = q(x)
    scale = 448.0 / amax
    ref = (x * scale).to(torch.float8_e4m3fn).to(torch.float32) / scale
    diff = float((got - ref).abs().max())
    return {
        "ok": diff <= 1e-6 * amax,
        "max_abs_diff_vs_torch_float8_e4m3fn": diff,
        "distinct_values": int(torch.unique(got).numel()),
        "quantizer": str(q),
    }


def recipe_name(recipe):
    # str(QuantRecipe): "INT8_DEFAULT_CFG(effective-bits: 8.0)", "None(...)"
    name = str(recipe).split("(")[0]
    return {
        "INT8_DEFAULT_CFG": "int8",
        "FP8_DEFAULT_CFG": "fp8",
        "None": "none",
        "NONE": "none",
    }.get(name, name)


def layer_map(onnx_path):
    """ONNX node name -> (node name, weight initializer name); the weight's
    name carries the Keras layer's (e.g. `model_1/stem_1/convolution/...`).

    Keyed as onnx2torch names modules: "." in a node name becomes "/".
    """
    import onnx

    graph = onnx.load(onnx_path, load_external_data=False).graph
    return {
        n.name.replace(".", "/"): (n.name, n.input[1])
        for n in graph.node
        if n.op_type in ("Conv", "MatMul", "Gemm") and len(n.input) > 1
    }


def formats_of(recipe, weights, state):
    """Per-layer formats of a searched recipe ({hparam name: recipe}); a
    grouped hparam (Q, K, V) is listed once per module, with its group."""
    layers = {}
    for hparam, choice in recipe.items():
        group = hparam.removesuffix(".quant_recipe")
        stats = state["candidate_stats"].get(hparam, {})
        names = list(stats.get("module_names") or [group])
        for name in names:
            # A padded Conv becomes Sequential(pad, conv): module "<node>.1".
            node, weight = weights.get(name) or weights.get(
                name.rsplit(".", 1)[0], (None, None)
            )
            layers[name] = {
                "format": recipe_name(choice),
                "onnx_node": node,
                "onnx_weight": weight,
            }
            if len(names) > 1:
                layers[name]["group"] = group
    counts = {}
    for v in layers.values():
        counts[v["format"]] = counts.get(v["format"], 0) + 1
    return layers, counts


def quantizer_summary(model):
    """What each weighted module's quantizers do after the search."""
    out = {}
    for name, m in model.named_modules():
        wq = getattr(m, "weight_quantizer", None)
        iq = getattr(m, "input_quantizer", None)
        if wq is None or iq is None:
            continue

        def state(q):
            if not q.is_enabled:
                return "off"
            return "fp8" if q.num_bits == (4, 3) else f"int{q.num_bits}"

        out[name] = {"weight": state(wq), "input": state(iq)}
    return out


def main():
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--setup-venv",
        metavar="PATH",
        help="only create the ModelOpt venv at PATH (with SETUP) and exit",
    )
    p.add_argument("--onnx", help="float ONNX (keras_mp)")
    p.add_argument(
        "--data",
        help=".npz with x_calib, y_calib, x_eval, y_eval (NHWC float32)",
    )
    p.add_argument("--out", help="JSON to write")
    p.add_argument("--name", default=None, help="model name in the JSON")
    p.add_argument(
        "--effective-bits",
        type=float,
        nargs="+",
        default=[8.0, 12.0],
        help="targets; the search runs under the first, the others are "
        "re-solved from its scores (default: %(default)s)",
    )
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=FORMATS)
    p.add_argument(
        "--method", default="gradient", choices=("gradient", "kl_div")
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--calib-images",
        type=int,
        default=None,
        help="calibration and scoring images (default: all of x_calib)",
    )
    p.add_argument("--eval-images", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--no-qkv-group",
        action="store_true",
        help="do not add KERAS_QKV_RULE to ModelOpt's quant_grouping_rules",
    )
    a = p.parse_args()
    if a.setup_venv:
        setup_venv(a.setup_venv)
        return
    if not (a.onnx and a.data and a.out):
        p.error("--onnx, --data and --out are required")

    out = {
        "model": a.name or os.path.splitext(os.path.basename(a.onnx))[0],
        "onnx": a.onnx,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "errors": {},
    }
    start_all = time.perf_counter()

    def fail(step, e):
        traceback.print_exc()
        out["errors"][step] = error_text(e)
        log(f"{step} FAILED: {error_text(e)}")

    def save():
        out["total_seconds"] = round(time.perf_counter() - start_all, 1)
        write_json(a.out, out)

    try:
        import torch

        torch.set_num_threads(a.threads)
        note = stub_torchvision()
        if note:
            out["notes"] = [note]
        import modelopt.torch.quantization as mtq
    except Exception as e:
        fail("import", e)
        save()
        return
    out["versions"] = versions()

    d = np.load(a.data)
    xc, yc = d["x_calib"][: a.calib_images], d["y_calib"][: a.calib_images]
    xe, ye = d["x_eval"][: a.eval_images], d["y_eval"][: a.eval_images]
    xc, xe = xc.astype(np.float32), xe.astype(np.float32)
    yc, ye = yc.astype(np.int64), ye.astype(np.int64)
    out["data"] = {
        "calib_images": int(len(xc)),
        "eval_images": int(len(xe)),
        "batch": a.batch,
    }

    log(f"{out['model']}: onnx2torch")
    model = None
    try:
        start = time.perf_counter()
        model, info = convert(a.onnx)
        info["seconds"] = round(time.perf_counter() - start, 1)
        info["ok"] = True
        out["conversion"] = info
    except Exception as e:
        out["conversion"] = {"ok": False}
        fail("onnx2torch", e)

    float_logits = None
    if model is not None:
        try:
            float_logits = logits_of(model, xe)
            out["float_top1"] = top1(float_logits, ye)
            ref = ort_logits(a.onnx, xe)
            out["ort_float_top1"] = top1(ref, ye)
            diff = float(np.abs(float_logits - ref).max())
            agree = float(
                np.mean(np.argmax(float_logits, -1) == np.argmax(ref, -1))
            )
            out["conversion"].update(
                max_abs_logit_diff_vs_ort=diff,
                top1_agreement_vs_ort=round(100 * agree, 2),
                matches_ort=bool(
                    diff <= CONVERSION_TOL * max(1.0, float(np.abs(ref).max()))
                ),
            )
            shown = f"{out['float_top1']} (ORT {out['ort_float_top1']})"
            log(f"float top-1 {shown}")
        except Exception as e:
            fail("float_eval", e)

    if "fp8" in a.formats:
        try:
            out["fp8_cpu_probe"] = fp8_probe()
        except Exception as e:
            out["fp8_cpu_probe"] = {"ok": False}
            fail("fp8_cpu_probe", e)

    if model is None:
        save()
        return

    cfgs = {"int8": mtq.INT8_DEFAULT_CFG, "fp8": mtq.FP8_DEFAULT_CFG}
    formats = [cfgs[f] for f in a.formats]
    loader = batches(xc, yc, a.batch)
    steps = len(loader)
    counts = {"forward_step": 0, "forward_backward_step": 0}
    loss_fn = torch.nn.CrossEntropyLoss()

    def forward_step(m, batch):
        counts["forward_step"] += 1
        return m(batch[0])

    def loss_func(output, batch):
        return loss_fn(output, batch[1])

    def forward_backward_step(m, batch):
        counts["forward_backward_step"] += 1
        loss_func(m(batch[0]), batch).backward()

    base = copy.deepcopy(model)
    weights = layer_map(a.onnx)
    target = a.effective_bits[0]
    constraints = {"effective_bits": target}
    search = {
        "api": "mtq.auto_quantize",
        "constraints": constraints,
        "quantization_formats": [f"{f.upper()}_DEFAULT_CFG" for f in a.formats],
        "method": a.method,
        "loss": "cross-entropy on labels"
        if a.method == "gradient"
        else "KL divergence to the float logits",
        "num_calib_steps": steps,
        "num_score_steps": steps,
    }
    out["search"] = search
    if not a.no_qkv_group:
        from modelopt.torch.quantization.algorithms import AutoQuantizeSearcher

        rules = AutoQuantizeSearcher.quant_grouping_rules
        if KERAS_QKV_RULE not in rules:
            rules.append(KERAS_QKV_RULE)
        search["quant_grouping_rules_added"] = [KERAS_QKV_RULE]
    log(f"auto_quantize, effective_bits {target}, {steps} batches of {a.batch}")
    state = None
    phases = time_phases()
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        qmodel, state = mtq.auto_quantize(
            model,
            constraints=constraints,
            quantization_formats=formats,
            data_loader=loader,
            forward_step=forward_step,
            loss_func=loss_func if a.method == "gradient" else None,
            forward_backward_step=forward_backward_step
            if a.method == "gradient"
            else None,
            num_calib_steps=steps,
            num_score_steps=steps,
            verbose=True,
            method=a.method,
        )
        search["seconds"] = round(time.perf_counter() - start, 1)
        # On a shared machine, wall time far above CPU time / threads means
        # the search waited for a core.
        search["cpu_seconds"] = round(time.process_time() - cpu_start, 1)
        if phases is not None:
            search["phases_seconds"] = dict(phases)
            search["phases_seconds"]["rest (setup, search, LP solve)"] = round(
                search["seconds"] - sum(phases.values()), 1
            )
        search["forward_passes"] = counts["forward_step"]
        search["backward_passes"] = counts["forward_backward_step"]
        search["forward_passes_note"] = (
            "forward_step calls (calibration, once per batch per format); "
            "backward_passes: forward_backward_step calls (scoring), each "
            "one forward and one backward over a batch"
        )
        best = state["best"]
        layers, summary = formats_of(best["recipe"], weights, state)
        search.update(
            ok=True,
            is_satisfied=bool(best["is_satisfied"]),
            score=float(best["score"]),
        )
        entry = {
            "effective_bits_target": target,
            "effective_bits": float(best["constraints"]["effective_bits"]),
            "is_satisfied": bool(best["is_satisfied"]),
            "formats_summary": summary,
            "layers": layers,
            "quantizers": quantizer_summary(qmodel),
            "seconds": search["seconds"],
        }
        q_logits = logits_of(qmodel, xe)
        entry["top1"] = top1(q_logits, ye)
        entry["top1_agreement_vs_float"] = agreement(q_logits, float_logits)
        out["targets"] = [entry]
        log(
            f"effective bits {entry['effective_bits']:.3f}: {summary}, "
            f"top-1 {entry['top1']}"
        )
    except Exception as e:
        search["ok"] = False
        search["seconds"] = round(time.perf_counter() - start, 1)
        fail("auto_quantize", e)
        save()
        return
    save()

    for bits in a.effective_bits[1:]:
        log(f"re-solve at effective_bits {bits}")
        entry = {"effective_bits_target": bits}
        out["targets"].append(entry)
        try:
            start = time.perf_counter()
            config = mtq.get_auto_quantize_config(
                state, constraints={"effective_bits": bits}
            )
            # The per-layer choice behind that config (what
            # get_auto_quantize_config solves internally; private in 0.47).
            from modelopt.torch.quantization.algorithms import (
                _resolve_best_recipe,
            )

            recipe = _resolve_best_recipe(state, {"effective_bits": bits})
            layers, summary = formats_of(recipe, weights, state)
            entry["effective_bits"] = searched_bits(state, recipe)
            entry["formats_summary"] = summary
            entry["layers"] = layers
            fresh = copy.deepcopy(base)
            calib_counts = counts["forward_step"]

            def forward_loop(m):
                for batch in loader:
                    forward_step(m, batch)

            fresh = mtq.quantize(fresh, config, forward_loop)
            entry["forward_passes"] = counts["forward_step"] - calib_counts
            entry["seconds"] = round(time.perf_counter() - start, 1)
            entry["quantizers"] = quantizer_summary(fresh)
            q_logits = logits_of(fresh, xe)
            entry["top1"] = top1(q_logits, ye)
            entry["top1_agreement_vs_float"] = agreement(q_logits, float_logits)
            log(
                f"effective bits {entry['effective_bits']}: {summary}, "
                f"top-1 {entry['top1']}"
            )
        except Exception as e:
            entry["error"] = error_text(e)
            fail(f"re-solve {bits}", e)
        save()
    save()


def searched_bits(state, recipe):
    """ModelOpt's effective bits of a per-layer recipe: the chosen formats'
    weight costs (from the search's candidate_stats) over the unquantized
    cost, times 16."""
    stats = state["candidate_stats"]
    total = state.get("cost_denominator") or sum(
        s.get("uncompressed_cost", max(s["costs"])) for s in stats.values()
    )
    cost = sum(
        stats[name]["costs"][list(stats[name]["formats"]).index(choice)]
        for name, choice in recipe.items()
    )
    return round(16.0 * cost / total, 4)


if __name__ == "__main__":
    main()
