"""Formulas as MathML, which browsers draw themselves, so the book reads the same offline.

Sphinx's own HTML math renderers need MathJax from a CDN (sphinx.ext.mathjax) or LaTeX and dvipng on
the machine that builds (sphinx.ext.imgmath); latex2mathml is pure Python and loads nothing.
"""
from docutils import nodes
from latex2mathml.converter import convert


def inline(self, node):
    self.body.append(convert(node.astext()))
    raise nodes.SkipNode


def block(self, node):
    self.body.append(f'<div class="math">{convert(node.astext(), display="block")}</div>\n')
    raise nodes.SkipNode


def setup(app):
    app.add_html_math_renderer("mathml", (inline, None), (block, None))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
