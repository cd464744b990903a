"""A small document engine: a report is a list of blocks (headings, paragraphs, tables, figures), rendered to HTML and
to markdown from the same blocks, so that both formats say the same thing.

The HTML file is self-contained (CSS inline, PNGs embedded as base64): mail it, attach it to a ticket, open it offline.
The markdown file links the PNGs written beside it, which is what code hosts render. What a report says lives in
taxbench.analysis.report; this knows nothing of experiments.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

from taxbench.analysis.results import may_write_result, write_result
from taxbench.oserrors import describe_os_error
from taxbench.rundir.json_object import ResultWriteError

REPORT_DIR = "report"
HTML_FILE = "report.html"
MARKDOWN_FILE = "report.md"


# ----------------------------------------------------------------------------------------------------- document model
@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Paragraph:
    text: str  # plain text; **bold** spans are rendered in both formats
    tone: str = ""  # "", "good", "bad", "warn": a coloured box in HTML, a prefix in markdown


@dataclass
class TableBlock:
    header: list[str]
    rows: list[list[str]]
    highlight: list[bool] = field(default_factory=list)  # rows to mark (differences, failing gates)
    # (row, column) -> another report's folder, relative: HTML links its report.html, markdown its report.md
    report_links: dict[tuple[int, int], str] = field(default_factory=dict)
    collapsed: str = ""  # when set, the table is folded under this summary line
    highlight_class: str = "hl"  # "hl": a difference (yellow); "bad": a failure (red)


@dataclass
class Figure:
    filename: str
    png: bytes
    alt: str


Block = Heading | Paragraph | TableBlock | Figure


@dataclass
class Report:
    title: str
    blocks: list[Block]

    def figures(self) -> list[Figure]:
        return [b for b in self.blocks if isinstance(b, Figure)]


# ------------------------------------------------------------------------------------------------------- rendering
_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{font-size:1.6em;border-bottom:2px solid #ddd;padding-bottom:.3em}h2{font-size:1.25em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top;font-family:ui-monospace,monospace}
th{background:#f3f3f3;font-family:inherit}
tr.hl td{background:#fff3c4}tr.bad td{background:#f8d0cc}
.box{padding:.6em 1em;border-radius:4px;margin:.6em 0;border-left:5px solid #999;background:#f6f6f6}
.good{border-color:#2e7d32;background:#edf7ed}.bad{border-color:#c62828;background:#fdecea}
.warn{border-color:#ed6c02;background:#fff4e5}code{font-family:ui-monospace,monospace;font-size:.9em}
img{max-width:100%;border:1px solid #eee}details summary{cursor:pointer;margin:.4em 0}
"""
_MARKDOWN_TONE = {"good": "✅ ", "bad": "❌ ", "warn": "⚠️ ", "": ""}


def _inline_html(text: str) -> str:
    """**bold** and `code` spans (markdown's own syntax, so report.md shows them the same)."""
    def bold(span: str) -> str:
        return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(span.split("**")))

    spans = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else bold(p) for i, p in enumerate(spans))


def to_html(report: Report) -> str:
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(report.title)}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{html.escape(report.title)}</h1>"]
    for block in report.blocks:
        if isinstance(block, Heading):
            out.append(f"<h{block.level}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            css = f"box {block.tone}" if block.tone else ""
            out.append(f"<p class='{css}'>{_inline_html(block.text)}</p>")
        elif isinstance(block, Figure):
            data = base64.b64encode(block.png).decode("ascii")
            out.append(f"<p><img alt='{html.escape(block.alt)}' src='data:image/png;base64,{data}'></p>")
        else:
            rows = []
            for r, row in enumerate(block.rows):
                cells = []
                for c, value in enumerate(row):
                    text = _inline_html(value)
                    if (r, c) in block.report_links:
                        href = f"{block.report_links[r, c]}/{HTML_FILE}"
                        text = f"<a href='{html.escape(href)}'>{text}</a>"
                    cells.append(f"<td>{text}</td>")
                marked = f" class='{block.highlight_class}'" if r < len(block.highlight) and block.highlight[r] else ""
                rows.append(f"<tr{marked}>{''.join(cells)}</tr>")
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block.header)
            table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            if block.collapsed:
                table = f"<details><summary>{html.escape(block.collapsed)}</summary>{table}</details>"
            out.append(table)
    out.append("</body></html>")
    return "\n".join(out)


def _md_cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ") or " "


def to_markdown(report: Report) -> str:
    out = [f"# {report.title}", ""]
    for block in report.blocks:
        if isinstance(block, Heading):
            out += ["#" * block.level + " " + block.text, ""]
        elif isinstance(block, Paragraph):
            prefix = "> " if block.tone else ""
            out += [prefix + _MARKDOWN_TONE[block.tone] + block.text, ""]
        elif isinstance(block, Figure):
            out += [f"![{block.alt}]({block.filename})", ""]
        else:
            if block.collapsed:
                out += ["<details>", f"<summary>{block.collapsed}</summary>", ""]
            out.append("| " + " | ".join(_md_cell(h) for h in block.header) + " |")
            out.append("|" + "---|" * len(block.header))
            for r, row in enumerate(block.rows):
                cells = []
                for c, value in enumerate(row):
                    cell = _md_cell(value)
                    if (r, c) in block.report_links:
                        cell = f"[{cell}]({block.report_links[r, c]}/{MARKDOWN_FILE})"
                    cells.append(cell)
                if r < len(block.highlight) and block.highlight[r]:
                    cells[0] = f"**{cells[0]}** ⚠"
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
            if block.collapsed:
                out += ["</details>", ""]
    return "\n".join(out)


def write_report(report: Report, out_dir: Path) -> Path | None:
    """Write report.html, report.md and the figures' PNGs into out_dir; returns the HTML path (None: not written, the
    folder is held by a live launch: taxbench.rundir.write_scope).

    A folder that cannot be created or written is a ResultWriteError naming it (one line, no traceback).
    """
    if not may_write_result(out_dir / HTML_FILE):
        return None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ResultWriteError(f"cannot create the report folder {out_dir}: a file is in the way "
                               f"({exc.strerror}); move it aside and report again") from exc
    except OSError as exc:
        raise ResultWriteError(f"cannot create the report folder: {describe_os_error(exc, out_dir)}; make "
                               f"{out_dir.parent} writable (or copy the results to a writable folder)") from exc
    for figure in report.figures():
        write_result(out_dir / figure.filename, figure.png)
    write_result(out_dir / MARKDOWN_FILE, to_markdown(report))
    path = out_dir / HTML_FILE
    write_result(path, to_html(report))
    return path
