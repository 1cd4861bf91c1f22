"""A DICOM network node around ``ExamPredictor``: receive (C-STORE SCP), spool, predict, send
the SR and presentation states back (C-STORE SCU). ``tools/serve.py`` is its command line."""
from .scp import AllowEntry, StoreSCP, inspect_instance
from .sender import Destination, ResultSender
from .server import DicomNode, NodeSettings, client_tls_context, server_tls_context
from .spool import Spool

__all__ = ["AllowEntry", "Destination", "DicomNode", "NodeSettings", "ResultSender", "Spool",
           "StoreSCP", "client_tls_context", "inspect_instance", "server_tls_context"]
