"""Sessions: partition a model, compile its parts, run it.

``create`` (``create_session``: options, devices and the model checked, one EP per
factory), ``session`` (`Session`), ``node_arg`` (inputs and outputs as onnxruntime's ``NodeArg``),
``plan`` (partition, compile, place initializers), ``run`` (one ``run``: inputs in, steps on
their streams, outputs out), ``values`` (inputs and outputs, checked), ``workers`` (the
session's threads), ``io_binding`` (`IOBinding`), ``partition`` (EPs claim nodes, as ORT's
partitioner does), ``cpu_fallback`` (onnxruntime runs what no EP claimed),
``external_data`` (where a model's tensors live outside it) and ``initializers`` (loading
them, through the EP's loader or the chunked one), and ``host`` (`SessionHost`: what a
session needs of its environment).

Imports every layer below it. The environment that creates a session sits above: what a
session needs of it is declared here (``host.SessionHost``) and handed in.
"""
