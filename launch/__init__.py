"""aiak.launch — ``aiakrun`` (start training on one or many hosts, features switched on by
environment, no code change), ``aiak-doctor`` (checks of the machine and the variables), and the
start-up hook that activates aiak's features in the launched processes.

This package builds environments and starts torch's elastic launcher; it imports no other aiak
subpackage at import time (the start-up hook and the doctor import them lazily, when asked).
Importing ``aiak.launch`` imports nothing: the start-up hook must cost nothing when unused.
"""
