"""The native backend's kept sandboxes: an exec server inside one set of namespaces.

``kept`` starts and ends a sandbox, ``protocol`` speaks to its exec server
(csrc/execserver.c), ``commands`` runs commands and ``files`` performs file
operations through it. One-shot runs are ``isolate.native`` and ``isolate.popen``.
"""
