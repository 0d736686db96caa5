"""Records allocation traces of real models and PyTorch's own memory figures for them.
usage: record.py MODEL   (PYTORCH_CUDA_ALLOC_CONF as wanted; RECORD=1 writes $DEST/MODEL.<tag>.pickle.xz)
Based on shared/tools/torch_traces.py (same recording calls, same figures), with more models."""
import os, sys, pickle, json, lzma, random, time
import torch

model_name = sys.argv[1]
conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default") or "default"
record = os.environ.get("RECORD", "0") == "1"
dev = "cuda"
random.seed(0); torch.manual_seed(0)


def run_bert_serve():  # as torch_traces.py
    from transformers import BertConfig, BertModel
    m = BertModel(BertConfig()).to(dev).eval().half()
    with torch.no_grad():
        for step in range(40):
            B = random.randint(1, 64); L = random.choice([64, 128, 192, 256, 384, 512])
            ids = torch.randint(0, 30522, (B, L), device=dev)
            m(ids).last_hidden_state.sum().item()


def run_llama_decode():  # as torch_traces.py
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    m = LlamaForCausalLM(cfg).to(dev).eval().to(torch.bfloat16)
    with torch.no_grad():
        for req in range(4):
            B = random.choice([1, 4, 8, 16]); L = random.choice([128, 256, 512])
            ids = torch.randint(0, 32000, (B, L), device=dev)
            out = m(ids, use_cache=True); past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            for t in range(48):
                out = m(nxt, past_key_values=past, use_cache=True); past = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
            del out, past, nxt


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    return LlamaForCausalLM(cfg).to(dev).eval().to(torch.bfloat16)


def _generate(m, B, L, new):
    # greedy generation as a server runs it: prefill keeping only the last logits, then decode
    ids = torch.randint(0, 32000, (B, L), device=dev)
    out = m(ids, use_cache=True, logits_to_keep=1); past = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)
    for t in range(new):
        out = m(nxt, past_key_values=past, use_cache=True, logits_to_keep=1); past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
    nxt.cpu()
    del out, past, nxt, ids


def run_llama_serve_random():
    # serving with random batch (1..32) and random prompt length (16..1024, any integer)
    m = _llama()
    with torch.no_grad():
        for req in range(12):
            _generate(m, random.randint(1, 32), random.randint(16, 1024), random.randint(8, 32))


def run_llama_serve_fixed():
    # serving with fixed shapes: batch 8, prompt 512, 32 new tokens
    m = _llama()
    with torch.no_grad():
        for req in range(6):
            _generate(m, 8, 512, 32)


def run_bert_train_varlen():
    # masked-LM training with random batch (8..32) and random sequence length (32..512, any integer)
    from transformers import BertConfig, BertForMaskedLM
    m = BertForMaskedLM(BertConfig()).to(dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for step in range(10):
        B = random.randint(8, 32); L = random.randint(32, 512)
        ids = torch.randint(0, 30522, (B, L), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)


def run_vit_train_fixed():
    # ViT-B/16 training with fixed shapes: batch 32 at 224x224
    import torchvision
    m = torchvision.models.vit_b_16().to(dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for step in range(6):
        x = torch.randn(32, 3, 224, 224, device=dev); y = torch.randint(0, 1000, (32,), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)


runs = {k[4:]: v for k, v in globals().items() if k.startswith("run_")}
if record:
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=2_000_000)
t = time.perf_counter()
runs[model_name]()
torch.cuda.synchronize()
el = time.perf_counter() - t
st = torch.cuda.memory_stats()
res = {"model": model_name, "conf": conf, "seconds": round(el, 2),
       "peak_allocated": st["allocated_bytes.all.peak"], "peak_reserved": st["reserved_bytes.all.peak"],
       "peak_requested": st.get("requested_bytes.all.peak"),
       "num_device_alloc": st.get("num_device_alloc"), "num_device_free": st.get("num_device_free"),
       "num_alloc_retries": st["num_alloc_retries"], "allocs": st["allocation.all.allocated"]}
res["reserved_over_requested"] = round(res["peak_reserved"] / res["peak_requested"], 4)
res["reserved_over_allocated"] = round(res["peak_reserved"] / res["peak_allocated"], 4)
print("FIGURES " + json.dumps(res), flush=True)
if record:
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    n = sum(len(t) for t in snap["device_traces"])
    tag = "default" if conf == "default" else "expandable"
    path = os.path.join(os.environ.get("DEST", "."), f"{model_name}.{tag}.pickle.xz")
    with lzma.open(path, "wb", preset=6) as f:
        pickle.dump(snap, f)
    print(f"trace {model_name} {tag}: {n} events, {os.path.getsize(path)>>10} KiB", flush=True)
