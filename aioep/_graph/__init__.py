"""The graph view: what an EP sees of a model, and the ONNX models built from it.

``graph`` (`GraphView`, its nodes and initializers), ``types`` (value and
node types), ``inference`` (shape inference), ``order`` (topological order),
``onnx_models`` (whole models as onnxruntime loads them) and ``ort_compat`` (what the
installed onnxruntime reads).

Imports only ``_base``: the graph knows no device.
"""
