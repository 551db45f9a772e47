"""A thread-safe text sink for `launcher.launch(out=...)` in tests: the
launcher's reader threads write the processes' lines into it."""
import threading


class Lines:

  def __init__(self):
    self.text, self._lock = '', threading.Lock()

  def write(self, s):
    with self._lock:
      self.text += s

  def flush(self):
    pass
