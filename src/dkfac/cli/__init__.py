"""The ``dkfac`` command (:func:`dkfac.cli.main.main`): ``train``, ``compare`` and ``bench``.

Nothing is imported here: ``dkfac.bench`` uses the command's configuration errors, and the
command imports the benchmark harness.
"""
