"""The config file on disk as the gateway sees it: its text, whether it changed since last read (the file
watcher's poll), and how it stands against the running version (``tandem ctl status``'s ``file`` line and the
weights it would set)."""

from __future__ import annotations

import contextlib
import os

from gateway.config.compile import load_config_text
from gateway.config.layers import route_weights
from gateway.config.schema import ConfigError
from gateway.config.versions import same_document


class ConfigFile:
    """The YAML file at ``path`` (None: a gateway started from text, which has no file).

    ``changed`` compares the file's (mtime, size) with the last mark; ``mark`` sets it to now, ``unmark`` makes the
    next poll see a change (a change that could not be applied yet is tried again)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._mark = self._stat()
        self._refused: tuple[str, str] | None = None   # (a text that loads, why a reload refused to apply it)

    def refused(self, text: str, why: str) -> bool:
        """A reload refused to apply the file's ``text`` although it loads (it would orphan a rollout, Redis was
        unreachable): ``status`` says so while the file holds that text. Whether the text is news (not the one
        refused last)."""
        news = self._refused is None or self._refused[0] != text
        self._refused = (text, why)
        return news

    def read(self) -> str | None:
        """The file's text; None without a file or when it cannot be read."""
        if not self.path:
            return None
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read()
        except OSError:
            return None

    def mark(self) -> None:
        """The file as it is now is the one last read."""
        self._mark = self._stat()

    def unmark(self) -> None:
        """The next ``changed`` is True while the file exists."""
        self._mark = None

    def moved(self) -> bool:
        """Whether the file's (mtime, size) moved since the last mark, leaving the mark as it is."""
        m = self._stat()
        return m is not None and m != self._mark

    def changed(self) -> bool:
        """Whether the file's (mtime, size) moved since the last mark (it is then marked)."""
        m = self._stat()
        if m is None or m == self._mark:
            return False
        self._mark = m
        return True

    def status(self, running_text: str, overrides: dict) -> dict:
        """``{"path", "differs", "refused", "status"}`` against the running version (its file text and operator
        ``overrides``; a file whose text differs only in comments or layout does not differ): "in sync",
        "weights overrides active", "file does not load (the running version is kept): <why>" (an edit a reload
        refused), "file not applied (the running version is kept): <why>" (an edit that loads, refused by the
        reload: ``refused``), or "runtime override active, file differs" (a rollback, or another replica's file,
        runs instead of it), or "file cannot be read (the running version is kept): <why>" (deleted, unreadable: a
        trial's deleted file read "in sync"); ``refused``: True with any "file ..." status (the file's edit does
        not run)."""
        text = self.read()
        differs = text is not None and not same_document(text, running_text)
        status, refused = "weights overrides active" if overrides else "in sync", False
        if text is None and self.path:
            try:
                open(self.path, encoding="utf-8").close()
                why = "it changed while read"
            except OSError as e:
                why = e.strerror or type(e).__name__
            status, refused = f"file cannot be read (the running version is kept): {why}", True
        elif differs:
            try:
                load_config_text(text, {}, source=self.path)
                status = "runtime override active, file differs"
                if refused := self._refused is not None and self._refused[0] == text:
                    status = f"file not applied (the running version is kept): {self._refused[1]}"
            except ConfigError as e:
                status, refused = f"file does not load (the running version is kept): {e}", True
        return {"path": self.path, "differs": differs, "refused": refused, "status": status}

    def weights_if_differs(self, running_text: str) -> dict[str, dict[str, float]] | None:
        """route -> {target id: weight} of the file when its document is not the running one and it loads; else
        None (``layers.layer_view``'s ``on_disk``)."""
        text = self.read()
        if text is None or same_document(text, running_text):
            return None
        with contextlib.suppress(ConfigError):
            return route_weights(load_config_text(text, {}).policy)
        return None

    def _stat(self) -> tuple[int, int] | None:
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
            return (st.st_mtime_ns, st.st_size)
        except OSError:
            return None
