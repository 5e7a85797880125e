"""What the communicator and its backends run on: finding the ranks and their groups
(``bootstrap``), which ranks share a machine (``topology``), describing arrays of any library
(``arrays``) and buffers every rank of a machine maps (``shared``)."""
