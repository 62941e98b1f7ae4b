"""Writes docs/deploy.svg, the picture of docs/deploy.md: hosts, processes, ports, sockets,
tokens and the config sections that connect them, for the examples of examples/.

    .venv/bin/python docs/deploy_diagram.py            # rewrites docs/deploy.svg
    .venv/bin/python docs/deploy_diagram.py --check    # exit 1 if docs/deploy.svg is stale

Plain SVG from the standard library: boxes, lines and text at fixed places (no layout engine to
install). tests/deploy/test_examples.py checks the committed SVG is this script's output."""
from __future__ import annotations

import sys
from pathlib import Path
from xml.sax.saxutils import escape

OUT = Path(__file__).resolve().parent / "deploy.svg"
W, H = 1200, 800
FONT = "font-family=\"DejaVu Sans Mono, Menlo, Consolas, monospace\""

# Frames: (x, y, w, h, title, fill)
DCS = [
    (15, 35, 575, 750, "TRAINING DC", "#f4f8fc"),
    (610, 35, 575, 750, "EVAL DC (across the WAN)", "#f7fbf4"),
]
# Hosts: (x, y, w, h, title, subtitle)
HOSTS = [
    (30, 70, 545, 285, "training host (GPU)", "examples/training-host/mnt-ckpt.toml, examples/gpu-host/governor.toml"),
    (30, 395, 400, 150, "storage node x N  (store-01.train.example, ...)", "examples/storage-node/storage.toml"),
    (30, 610, 545, 160, "object store  s3://ckpt/runs  (s3.train.example:9000)", "the store every role views"),
    (633, 70, 537, 285, "tier host  tier-01.eval.example", "examples/eval-tier/tier.toml"),
    (633, 430, 537, 215, "eval host", "examples/eval-host/mnt-ckpt.toml"),
]
# Processes: (x, y, w, h, [lines]); the first line is the process, in bold.
PROCS = [
    (45, 115, 140, 60, ["training job", "reads, writes", "/mnt/ckpt"]),
    (225, 110, 335, 122, ["hintfs mount /mnt/ckpt", "hintfs-mount@mnt-ckpt", "[journal] enabled",
                          "[agents] locations, token_file", "  agent.token, tls_root_file ca.pem",
                          "[stream] -> tier, tier.token",
                          "[metrics] 127.0.0.1:9464"]),
    (225, 250, 335, 45, ["stream sender (child of the mount)", "socket pair with the mount"]),
    (45, 210, 178, 130, ["hintfs governor", "hintfs-governor@governor", "socket (unix):", "/run/hintfs/",
                         "  governor.sock", "lock files beside it", "metrics: off"]),
    (45, 440, 370, 95, ["hintfs agent", "hintfs-agent@storage", "listens grpc+tls 0.0.0.0:8815",
                        "token /etc/hintfs/agent.token", "cert /etc/hintfs/tls/host.pem",
                        "replicas /var/lib/hintfs/replicas"]),
    (45, 655, 515, 100, ["checkpoints  ckpt/<job>/step_N/...", ".hintfs-journal/by-time/...  (one record per",
                         "  file the training mounts publish)", "read and written over S3 (HTTPS):",
                         "  mounts, and the agents' copies"]),
    (648, 115, 507, 230, ["hintfs agent", "hintfs-agent@tier", "listens grpc+tls 0.0.0.0:8815",
                          "token  /etc/hintfs/tier.token  (0600)",
                          "cert   /etc/hintfs/tls/host.pem + host.key",
                          "replicas  /var/lib/hintfs/tier",
                          "local_socket /run/hintfs/tier/local.sock (0600)",
                          "  replica fds for a mount on this host",
                          "[follow] prefixes = [\"ckpt\"]: the journal,",
                          "  then copies across the link",
                          "spool /var/cache/hintfs/spool"]),
    (648, 475, 145, 60, ["eval job", "reads", "/mnt/ckpt"]),
    (823, 475, 332, 155, ["hintfs mount /mnt/ckpt", "hintfs-mount@mnt-ckpt", "[[routes]] prefix = \"ckpt\"",
                          "  local_agent = grpc+tls://", "    tier-01.eval.example:8815",
                          "[agents] token_file tier.token", "  tls_root_file /etc/hintfs/tls/ca.pem",
                          "in-process agent: a 0700 unix socket",
                          "[metrics] 127.0.0.1:9464"]),
]
# Arrows: (points, label, label x, label y, style): style "tls" (grpc+tls, Flight), "unix", "store".
ARROWS = [
    ([(185, 145), (225, 145)], "FUSE", 188, 138, "unix"),
    ([(110, 175), (110, 210)], "unix socket", 115, 197, "unix"),
    ([(390, 232), (390, 250)], "", 0, 0, "unix"),
    ([(300, 232), (300, 395 + 45)], "hints: grpc+tls :8815, agent.token", 305, 385, "tls"),
    ([(415, 500), (470, 500), (470, 470), (415, 470)], "fan-out copies", 440, 462, "tls"),
    ([(540, 232), (540, 655)], "writes + journal (S3)", 448, 590, "store"),
    ([(560, 272), (648, 272)], "stream:\ngrpc+tls\n:8815\ntier.token", 564, 290, "tls"),
    ([(648, 320), (560, 700)], "[follow]: the journal, then\ncopies across the link (S3)", 642, 378, "store"),
    ([(985, 475), (985, 345)], "[[routes]]:\ngrpc+tls :8815\ntier.token", 992, 385, "tls"),
    ([(823, 630), (560, 735)], "reads not on the tier (S3)", 650, 700, "store"),
]
STYLE = {"tls": 'stroke="#1f5fbf" stroke-width="2.2"', "unix": 'stroke="#555" stroke-width="1.5" stroke-dasharray="5,4"',
         "store": 'stroke="#b0601a" stroke-width="1.8" stroke-dasharray="10,4"'}
COLOR = {"tls": "#1f5fbf", "unix": "#555", "store": "#b0601a"}
LEGEND = [("tls", "grpc+tls (Flight), token each call"),
          ("unix", "unix socket or FUSE, one host"),
          ("store", "the store's API (S3, HTTPS)")]


def _text(x: float, y: float, s: str, size: int = 12, weight: str = "normal", fill: str = "#111") -> str:
    return (f'<text x="{x}" y="{y}" font-size="{size}" font-weight="{weight}" fill="{fill}" {FONT} '
            f'xml:space="preserve">{escape(s)}</text>')


def render() -> str:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">',
           "<!-- generated by docs/deploy_diagram.py: edit that, then run it -->",
           "<defs>"]
    for style, color in COLOR.items():
        out.append(f'<marker id="arrow-{style}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                   f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{color}"/></marker>')
    out.append("</defs>")
    out.append(f'<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>')
    for x, y, w, h, title, fill in DCS:
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="10" fill="{fill}" stroke="#8aa" '
                   'stroke-width="1.5" stroke-dasharray="3,3"/>')
        out.append(_text(x + 10, y - 8, title, 14, "bold", "#345"))
    for x, y, w, h, title, sub in HOSTS:
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="6" fill="#ffffff" stroke="#333" stroke-width="1.5"/>')
        out.append(_text(x + 8, y + 17, title, 13, "bold"))
        out.append(_text(x + 8, y + 33, sub, 11, "normal", "#456"))
    for x, y, w, h, lines in PROCS:
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="4" fill="#fffbe8" stroke="#9a8a40"/>')
        for i, line in enumerate(lines):
            out.append(_text(x + 6, y + 15 + 13 * i, line, 11, "bold" if i == 0 else "normal"))
    for points, label, lx, ly, style in ARROWS:
        d = " ".join(f"{px},{py}" for px, py in points)
        out.append(f'<polyline points="{d}" fill="none" {STYLE[style]} marker-end="url(#arrow-{style})"/>')
        for i, line in enumerate(label.splitlines()):
            out.append(_text(lx, ly + 13 * i, line, 11, "bold", COLOR[style]))
    lx, ly = 870, 675
    out.append(_text(lx, ly, "lines", 12, "bold"))
    for i, (style, what) in enumerate(LEGEND):
        y = ly + 20 + 20 * i
        out.append(f'<line x1="{lx}" y1="{y - 4}" x2="{lx + 50}" y2="{y - 4}" {STYLE[style]}/>')
        out.append(_text(lx + 60, y, what, 11))
    out.append(_text(640, 770, "Every token and key file 0600, root's; ca.pem on every host.", 11, "normal", "#456"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    svg = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != svg:
            print(f"{OUT.name} is stale: run .venv/bin/python docs/deploy_diagram.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(svg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
