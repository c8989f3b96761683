"""The report as a document: paragraphs, tables and figures in sections, rendered twice.

``render_markdown`` writes GitHub Markdown (figures as PNG files under ``figures/``);
``render_html`` writes one self-contained page (the same PNGs embedded as base64 ``data:`` URIs,
inline CSS, a Content-Security-Policy that forbids every non-inline resource, so the page loads
with no network). ``audit.report`` decides what goes in the sections.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Para:
    text: str
    kind: str = "p"  # "p" | "note" (explanation) | "warn" (data problem) | "cost" (verdict sub-line)


@dataclass(frozen=True, slots=True)
class Table:
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]
    keys: list[str] | None = None  # per row, an HTML data-key (tests and readers can find a row)
    collapsed: bool = False  # long detail tables: folded in HTML (<details>), plain in Markdown


@dataclass(frozen=True, slots=True)
class Fig:
    name: str  # file stem under figures/
    png: bytes
    caption: str


@dataclass(slots=True)
class Section:
    id: str
    title: str
    blocks: list[Para | Table | Fig] = field(default_factory=list)


_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")


def _md(text: str) -> str:
    """Markdown text that no renderer can take for an HTML tag (``p<0.001`` stays as it is)."""
    return _TAG_START.sub("&lt;", str(text))


def _md_cell(text: str) -> str:
    return _md(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(title: str, sections: Sequence[Section]) -> str:
    lines = [f"# {_md(title)}", ""]
    for sec in sections:
        lines += [f"## {_md(sec.title)}", ""]
        for b in sec.blocks:
            if isinstance(b, Para):
                text = _md(b.text)
                lines += [{"warn": f"> {text}", "note": f"_{text}_", "cost": f"- {text}"}.get(b.kind, text), ""]
            elif isinstance(b, Table):
                header = b.header if any(b.header) else ("field", "value")
                lines.append("| " + " | ".join(_md_cell(h) for h in header) + " |")
                lines.append("|" + "|".join("---" for _ in header) + "|")
                lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
                lines.append("")
            else:
                lines += [f"![{_md_cell(b.caption)}](figures/{b.name}.png)", "", f"_{b.caption}_", ""]
    return "\n".join(lines).rstrip() + "\n"


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0 auto;max-width:1200px;
padding:1.5rem 2rem 4rem;color:#1d1d1f;line-height:1.45;background:#fff}
h1{font-size:1.7rem;margin:.2rem 0 1rem}h2{font-size:1.25rem;margin:2.2rem 0 .6rem;padding-bottom:.25rem;
border-bottom:2px solid #e5e5e5}
.scroll{overflow-x:auto;margin:.5rem 0 1rem}
table{border-collapse:collapse;font-size:.82rem;font-variant-numeric:tabular-nums}
th,td{border:1px solid #ddd;padding:.25rem .5rem;text-align:left;white-space:nowrap}
th{background:#f3f4f6;position:sticky;top:0}tr:nth-child(even) td{background:#fafafa}
td:first-child{font-weight:500}
td.long{white-space:normal;min-width:12rem}
table.facts td{white-space:normal;max-width:60rem;word-break:break-word}
p.note{color:#555;font-size:.88rem}p.warn{background:#fff4e5;border-left:4px solid #f0a020;padding:.4rem .7rem}
figure{margin:1rem 0 1.5rem}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:.85rem;color:#555;margin-top:.3rem}
#verdict{background:#f0f7f4;border:1px solid #b7dccb;border-radius:6px;padding:.4rem 1.2rem 1rem;margin-top:2.5rem}
#verdict h2{border:none}#verdict p{font-size:1rem}#verdict p.cost{margin-left:1.5rem;color:#333}
details{margin:.4rem 0 1rem}summary{cursor:pointer;color:#0b5cad;font-size:.9rem}
nav{font-size:.88rem;margin-bottom:1rem}nav a{margin-right:.9rem;color:#0b5cad;text-decoration:none}
"""

#: On load, count the images that decoded (naturalWidth > 0): a browser test reads these attributes.
SCRIPT = """
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  document.body.dataset.imagesTotal = String(imgs.length);
  document.body.dataset.imagesLoaded = String(imgs.filter(function (i) {
    return i.complete && i.naturalWidth > 0; }).length);
});
"""

#: Nothing but inline styles, inline scripts and data: images may load — the report needs no network.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"


def _cell(tag: str, text: str) -> str:
    """A table cell; long text (notes) wraps instead of widening the table."""
    cls = ' class="long"' if len(text) > 40 else ""
    return f"<{tag}{cls}>{html.escape(text)}</{tag}>"


def render_html(title: str, sections: Sequence[Section]) -> str:
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{e(title)}</title><style>{CSS}</style></head><body>", f"<h1>{e(title)}</h1>",
           "<nav>" + "".join(f'<a href="#{e(s.id)}">{e(s.title)}</a>' for s in sections) + "</nav>"]  # fmt: skip
    for sec in sections:
        out.append(f'<section id="{e(sec.id)}"><h2>{e(sec.title)}</h2>')
        for b in sec.blocks:
            if isinstance(b, Para):
                out.append(f'<p class="{e(b.kind)}">{e(b.text)}</p>')
            elif isinstance(b, Table):
                facts = not any(b.header)
                rows = []
                for i, row in enumerate(b.rows):
                    key = f' data-key="{e(b.keys[i])}"' if b.keys else ""
                    tag = ("th", "td") if facts else ("td", "td")
                    rows.append(f"<tr{key}>" + "".join(_cell(tag[j > 0], str(c)) for j, c in enumerate(row)) + "</tr>")
                head = "" if facts else "<thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in b.header) + "</tr></thead>"
                cls = ' class="facts"' if facts else ""
                table = f'<div class="scroll"><table{cls}>{head}<tbody>{"".join(rows)}</tbody></table></div>'
                if b.collapsed:
                    table = f"<details><summary>table: {len(b.rows)} rows</summary>{table}</details>"
                out.append(table)
            else:
                data = base64.b64encode(b.png).decode("ascii")
                out.append(f'<figure id="fig-{e(b.name)}"><img alt="{e(b.caption)}" src="data:image/png;base64,{data}">'
                           f"<figcaption>{e(b.caption)}</figcaption></figure>")  # fmt: skip
        out.append("</section>")
    out.append(f"<script>{SCRIPT}</script></body></html>")
    return "\n".join(out) + "\n"
