import os, sys, time, statistics, collections
import torch, timm
import aiak.ops.swin as swin
from torch.profiler import profile, ProfilerActivity

torch.backends.cudnn.benchmark = True
torch.backends.cuda.matmul.allow_tf32 = True
B = 64
dev = "cuda"
x = torch.randn(B, 3, 224, 224, device=dev)
y = torch.randint(0, 1000, (B,), device=dev)

def build(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = timm.create_model("swin_tiny_patch4_window7_224").to(dev)
    if mode in ("convert", "convert-attn"):
        swin.convert(m)
        if mode == "convert-attn":
            for b in m.modules():
                if hasattr(b, "_aiak_timm_attn"):
                    b._attn = b._aiak_timm_attn
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    cm = torch.compile(m) if comp else m
    def step():
        with torch.autocast("cuda", torch.float16):
            loss = torch.nn.functional.cross_entropy(cm(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)
        return loss
    return step

res = {}
for comp in (True, False):
  for mode in ("convert", "plain", "convert-attn"):
    if not comp and mode == "convert-attn":
        continue
    name = f"{mode}{'+compile' if comp else ''}"
    t0 = time.time()
    step = build(mode)
    for _ in range(3): step()
    torch.cuda.synchronize(); tc = time.time() - t0
    times = []
    for r in range(3):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(15): step()
        e.record(); torch.cuda.synchronize(); times.append(s.elapsed_time(e) / 15)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): step()
        torch.cuda.synchronize()
    agg = collections.defaultdict(float); cnt = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            agg[ev.name] += ev.device_time_total / 5; cnt[ev.name] += 1
    tot = sum(agg.values())
    print(f"\n=== {name}: step {statistics.median(times):.2f} ms (rounds {[round(t,2) for t in times]}), kernel time/step {tot/1000:.2f} ms, kernels/step {sum(cnt.values())//5}, warmup+compile {tc:.0f}s", flush=True)
    for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:22]:
        print(f"  {v/1000:7.3f} ms  x{cnt[k]//5:3d}  {k[:110]}")
