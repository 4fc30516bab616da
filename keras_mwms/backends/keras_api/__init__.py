"""The Keras firewall: the only code in keras_mwms that names Keras' private modules.

keras_mwms patches and calls some private Keras internals (see ARCHITECTURE.md's patch
tables). Every such name lives here, and nowhere else (tests/test_architecture.py fails if any
other module names `keras.src` or a private attribute of a Keras object):

- `anchors` — each private class or module found from a public one, along the MRO where it is
  a class (the trainer is "the class of keras.Model defining make_train_function"), so a
  renamed private class changes nothing;
- `targets` — every private attribute keras_mwms patches or calls, as `Target(anchor, path)`;
  the patch tables name these;
- `internals` — a named function for each private function or class keras_mwms calls;
- `attributes`, `optimizer_attributes` — a named accessor for each private attribute read,
  called or set on a Keras object (`attributes.PRIVATE_NAMES` lists them; no other module
  names one, tests/test_architecture.py checks);
- `usability` — `require_usable(backend)`: every name above resolved, and the releases checked,
  before the workers meet.

Example:

>>> import keras
>>> from keras_mwms.backends.keras_api import usability
>>> usability.missing_names(keras.backend.backend())
[]
"""
