"""The operator's console (nsqadmin's role): ``python -m actors.admin``; see
:mod:`actors.admin.admin`."""
