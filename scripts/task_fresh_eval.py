import sys, pathlib, torch
from mambakit.model import MambaLM
from mambakit.tasks import make_task, evaluate_length
t = make_task("selective-copying")
for name in sys.argv[1:]:
    run = pathlib.Path(".runs") / name
    ck = run / (run / "latest").read_text().strip()
    m = MambaLM.from_pretrained(ck).cuda().eval()
    for T in (128, 256):
        r = evaluate_length(m, t, T, rows=64, batch_size=64, chunk_len=4096, seed=0)
        print(f"fresh process {name} {ck.name} T {T}: {r.accuracy:.3f}", flush=True)
