"""The plugin API: what a plugin implements and what it calls. The algorithm (``algorithm``), the client trainer
and its context (``client``), the server aggregator and its context (``server``), their parameters (``params``)
and task (``task``); the messages between them (``protocol``), training loops (``training``), model-state
arithmetic (``state``), streaming means (``fold``), the registries plugins publish into (``registry``), the
per-client state stores (``clientstate``, ``serverstore``), the settings of adaptation before evaluation
(``adaptation``) and the client side of the global model's evaluation (``globalmodel``). Plugins reach all of it through ``pflkit.core``, never through these modules. May import
``common`` only.
"""
