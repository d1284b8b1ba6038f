"""The eager fast path in C: a CPython extension built at run time (``build.py``'s compiler and cache).

* ``apply``: ``dispatch._apply``'s common case in one C call: every input a Tensor on a host array
  that needs no gradient, outside any trace or profile, on a signature ``run_arrays`` has seen
  (the same key, the same ``spec.eager`` entry, the same kernel call, the result wrapped in a
  Tensor). Anything else returns None and takes the Python path, which also raises every error.
* Exact C twins of reference kernels (``TWINS``): they do the reference kernel's arithmetic in the
  same order and call numpy's own ufunc loops for its transcendental functions (numpy's ``exp``
  and ``tanh`` are its own approximations), so their results are the reference's bits. They
  cover C-contiguous float32/float64 arrays of finite values (softmax: along the last axis, -inf
  allowed where a row's max is finite) and call the reference kernel for everything else.

Without a working compiler or ``Python.h`` nothing changes; ``LLMKIT_EAGER_EXT=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from typing import Any

import numpy as np

from ... import dispatch
from ...opspec import OpError, get
from ...tensor import Tensor
from .. import build

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <numpy/ufuncobject.h>
#include <math.h>
#include <string.h>

static PyTypeObject *tensor_type;
static Py_ssize_t off_data, off_rg, off_grad, off_node, off_idx, off_name;
static PyObject *np_mod, *local_obj, *globals_dict, *op_error, *ref[3], *zero;
static PyObject *s_stack, *s_eager, *s_multi, *s_profile;
typedef void (*loop_t)(char **, npy_intp const *, npy_intp const *, void *);
static loop_t exp_loop[2], tanh_loop[2], log_loop[2];
static void *exp_data[2], *tanh_data[2], *log_data[2];

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

static int member_offset(PyObject *type, const char *name, Py_ssize_t *off) {
  PyObject *d = PyObject_GetAttrString(type, name);
  if (!d) return -1;
  int ok = Py_TYPE(d) == &PyMemberDescr_Type;
  if (ok) *off = ((PyMemberDescrObject *)d)->d_member->offset;
  Py_DECREF(d);
  if (!ok) PyErr_Format(PyExc_TypeError, "Tensor.%s is not a slot", name);
  return ok ? 0 : -1;
}

/* numpy's inner loop of a unary ufunc for float32 (0) and float64 (1): what it runs on them. */
static int ufunc_loops(const char *name, loop_t *loops, void **data) {
  PyUFuncObject *uf = (PyUFuncObject *)PyObject_GetAttrString(np_mod, name);
  if (!uf) return -1;
  loops[0] = loops[1] = NULL;
  for (int i = 0; i < uf->ntypes; i++) {
    char t0 = uf->types[i * uf->nargs], t1 = uf->types[i * uf->nargs + 1];
    for (int k = 0; k < 2; k++)
      if (t0 == t1 && t0 == (k ? NPY_DOUBLE : NPY_FLOAT) && !loops[k]) {
        loops[k] = (loop_t)uf->functions[i];
        data[k] = uf->data[i];
      }
  }
  Py_DECREF(uf);
  if (!loops[0] || !loops[1]) PyErr_Format(PyExc_RuntimeError, "numpy.%s has no float loops", name);
  return loops[0] && loops[1] ? 0 : -1;
}

static void run_loop(loop_t f, void *data, char *p, npy_intp n, npy_intp item) {  /* in place */
  char *args[2] = {p, p};
  npy_intp steps[2] = {item, item};
  f(args, &n, steps, data);
}

static PyObject *init(PyObject *self, PyObject *args) {
  PyObject *t;
  if (!PyArg_ParseTuple(args, "OOOOOOOO", &t, &np_mod, &local_obj, &globals_dict, &op_error, ref, ref + 1,
                        ref + 2))
    return NULL;
  Py_INCREF(t); Py_INCREF(np_mod); Py_INCREF(local_obj); Py_INCREF(globals_dict); Py_INCREF(op_error);
  Py_INCREF(ref[0]); Py_INCREF(ref[1]); Py_INCREF(ref[2]);
  tensor_type = (PyTypeObject *)t;
  if (member_offset(t, "_data", &off_data) || member_offset(t, "requires_grad", &off_rg) ||
      member_offset(t, "grad", &off_grad) || member_offset(t, "_node", &off_node) ||
      member_offset(t, "_out_idx", &off_idx) || member_offset(t, "name", &off_name))
    return NULL;
  if (ufunc_loops("exp", exp_loop, exp_data) || ufunc_loops("tanh", tanh_loop, tanh_data) ||
      ufunc_loops("log", log_loop, log_data))
    return NULL;
  zero = PyLong_FromLong(0);
  s_stack = PyUnicode_InternFromString("stack");
  s_eager = PyUnicode_InternFromString("eager");
  s_multi = PyUnicode_InternFromString("multi_output");
  s_profile = PyUnicode_InternFromString("profile_table");
  Py_RETURN_NONE;
}

static PyObject *shape_of(PyArrayObject *a) {
  int nd = PyArray_NDIM(a);
  PyObject *t = PyTuple_New(nd);
  if (!t) return NULL;
  for (int i = 0; i < nd; i++) {
    PyObject *d = PyLong_FromSsize_t(PyArray_DIM(a, i));
    if (!d) { Py_DECREF(t); return NULL; }
    PyTuple_SET_ITEM(t, i, d);
  }
  return t;
}

static PyObject *pair(PyArrayObject *a) {  /* (shape, dtype) */
  PyObject *s = shape_of(a);
  if (!s) return NULL;
  PyObject *p = PyTuple_Pack(2, s, (PyObject *)PyArray_DESCR(a));
  Py_DECREF(s);
  return p;
}

/* run_arrays' key: (shape, dtype[, shape, dtype]) or ((shape, dtype), ...), then the attributes. */
static PyObject *eager_key(PyObject **arrays, Py_ssize_t n, PyObject *attrs) {
  PyObject *key;
  if (n <= 2) {
    key = PyTuple_New(2 * n);
    for (Py_ssize_t i = 0; key && i < n; i++) {
      PyObject *s = shape_of((PyArrayObject *)arrays[i]);
      if (!s) { Py_CLEAR(key); break; }
      PyObject *dt = (PyObject *)PyArray_DESCR((PyArrayObject *)arrays[i]);
      Py_INCREF(dt);
      PyTuple_SET_ITEM(key, 2 * i, s);
      PyTuple_SET_ITEM(key, 2 * i + 1, dt);
    }
  } else {
    key = PyTuple_New(n);
    for (Py_ssize_t i = 0; key && i < n; i++) {
      PyObject *p = pair((PyArrayObject *)arrays[i]);
      if (!p) { Py_CLEAR(key); break; }
      PyTuple_SET_ITEM(key, i, p);
    }
  }
  Py_ssize_t na = PyDict_GET_SIZE(attrs);
  if (!key || !na) return key;
  PyObject *full = PyTuple_New(1 + 2 * na), *k, *v;
  if (!full) { Py_DECREF(key); return NULL; }
  PyTuple_SET_ITEM(full, 0, key);
  Py_ssize_t pos = 0, i = 0;
  while (PyDict_Next(attrs, &pos, &k, &v)) {
    PyObject *item = PyTuple_Pack(2, k, v);
    if (!item) { Py_DECREF(full); return NULL; }
    PyTuple_SET_ITEM(full, 1 + i, item);
    Py_INCREF(Py_TYPE(v));
    PyTuple_SET_ITEM(full, 1 + na + i, (PyObject *)Py_TYPE(v));
    i++;
  }
  return full;
}

static PyObject *wrap(PyObject *data) {  /* Tensor._wrap(data); steals data */
  PyObject *t = tensor_type->tp_alloc(tensor_type, 0);
  if (!t) { Py_DECREF(data); return NULL; }
  SLOT(t, off_data) = data;
  Py_INCREF(Py_False); SLOT(t, off_rg) = Py_False;
  Py_INCREF(Py_None); SLOT(t, off_grad) = Py_None;
  Py_INCREF(Py_None); SLOT(t, off_node) = Py_None;
  Py_INCREF(zero); SLOT(t, off_idx) = zero;
  Py_INCREF(Py_None); SLOT(t, off_name) = Py_None;
  return t;
}

static PyObject *wrap_data(PyObject *self, PyObject *data) {
  Py_INCREF(data);
  return wrap(data);
}

/* apply(spec, inputs, attrs): the Tensor, or None (the Python path runs the op). */
static PyObject *apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_CheckExact(args[1]) || !PyDict_CheckExact(args[2])) Py_RETURN_NONE;
  PyObject *spec = args[0], *inputs = args[1], *attrs = args[2];
  Py_ssize_t n = PyTuple_GET_SIZE(inputs);
  PyObject *argv[16];
  if (n == 0 || n > 8) Py_RETURN_NONE;
  argv[0] = np_mod;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *x = PyTuple_GET_ITEM(inputs, i);
    if (!PyObject_TypeCheck(x, tensor_type)) Py_RETURN_NONE;
    PyObject *d = SLOT(x, off_data);
    if (!d || Py_TYPE(d) != &PyArray_Type || SLOT(x, off_rg) != Py_False) Py_RETURN_NONE;
    argv[i + 1] = d;
  }
  PyObject *prof = PyDict_GetItemWithError(globals_dict, s_profile);
  if (prof != Py_None) { if (PyErr_Occurred()) return NULL; Py_RETURN_NONE; }
  PyObject *stack = PyObject_GetAttr(local_obj, s_stack);
  if (!stack) return NULL;
  int ambient = !PyList_CheckExact(stack) || PyList_GET_SIZE(stack) != 0;
  Py_DECREF(stack);
  PyObject *multi = PyObject_GetAttr(spec, s_multi);
  if (!multi) return NULL;
  Py_DECREF(multi);
  if (ambient || multi != Py_False) Py_RETURN_NONE;
  PyObject *key = eager_key(argv + 1, n, attrs);
  if (!key) return NULL;
  PyObject *eager = PyObject_GetAttr(spec, s_eager);
  if (!eager) { Py_DECREF(key); return NULL; }
  PyObject *entry = PyDict_CheckExact(eager) ? PyDict_GetItemWithError(eager, key) : NULL;
  Py_XINCREF(entry);
  Py_DECREF(eager);
  Py_DECREF(key);
  if (!entry) { PyErr_Clear(); Py_RETURN_NONE; }  /* a new signature, or an unhashable attribute */
  PyObject *bound = PyTuple_GET_ITEM(entry, 0), *kernel = PyTuple_GET_ITEM(entry, 1), *kwnames = NULL;
  Py_ssize_t nk = PyDict_GET_SIZE(bound);
  if (nk > 7) { Py_DECREF(entry); Py_RETURN_NONE; }
  if (nk) {
    kwnames = PyTuple_New(nk);
    if (!kwnames) { Py_DECREF(entry); return NULL; }
    PyObject *k, *v;
    Py_ssize_t pos = 0, i = 0;
    while (PyDict_Next(bound, &pos, &k, &v)) {
      Py_INCREF(k);
      PyTuple_SET_ITEM(kwnames, i, k);
      argv[n + 1 + i++] = v;
    }
  }
  PyObject *out = PyObject_Vectorcall(kernel, argv, n + 1, kwnames);
  Py_XDECREF(kwnames);
  Py_DECREF(entry);
  if (!out) {  /* the Python path runs it again and raises the op's error (an OpError: as it is) */
    if (PyErr_ExceptionMatches(op_error) || !PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  if (Py_TYPE(out) != &PyArray_Type) {  /* numpy scalars: xp.asarray */
    PyObject *a = PyArray_FROM_O(out);
    Py_DECREF(out);
    if (!a) return NULL;
    out = a;
  }
  return wrap(out);
}

/* The reference kernels' arithmetic, in their order (see the module docstring). */
#define PAIRWISE(T)                                                                          \
  static T pairwise_##T(const T *a, npy_intp n) { /* numpy's pairwise sum */                 \
    if (n < 8) {                                                                             \
      T res = 0.;                                                                            \
      for (npy_intp i = 0; i < n; i++) res += a[i];                                          \
      return res;                                                                            \
    }                                                                                        \
    if (n <= 128) {                                                                          \
      T r[8];                                                                                \
      npy_intp i;                                                                            \
      for (int k = 0; k < 8; k++) r[k] = a[k];                                               \
      for (i = 8; i < n - (n % 8); i += 8)                                                   \
        for (int k = 0; k < 8; k++) r[k] += a[i + k];                                        \
      T res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));             \
      for (; i < n; i++) res += a[i];                                                        \
      return res;                                                                            \
    }                                                                                        \
    npy_intp n2 = n / 2;                                                                     \
    n2 -= n2 % 8;                                                                            \
    return pairwise_##T(a, n2) + pairwise_##T(a + n2, n - n2);                               \
  }                                                                                          \
  /* e = x - rowmax; exp(e, e); e /= rowsum (0 + pairwise). 0: a NaN, +inf or an all -inf row */ \
  static int softmax_##T(const T *x, T *e, npy_intp rows, npy_intp cols, loop_t f, void *d) { \
    for (npy_intp r = 0; r < rows; r++) {                                                    \
      const T *xr = x + r * cols;                                                            \
      T m = xr[0];                                                                           \
      for (npy_intp j = 0; j < cols; j++) {                                                  \
        if (xr[j] != xr[j]) return 0;                                                        \
        m = xr[j] > m ? xr[j] : m;                                                           \
      }                                                                                      \
      if (!isfinite(m)) return 0;                                                            \
      for (npy_intp j = 0; j < cols; j++) e[r * cols + j] = xr[j] - m;                       \
    }                                                                                        \
    if (!f) return 1; /* x - max only (cross_entropy) */                                     \
    run_loop(f, d, (char *)e, rows * cols, sizeof(T));                                       \
    for (npy_intp r = 0; r < rows; r++) {                                                    \
      T *er = e + r * cols, s = (T)0 + pairwise_##T(er, cols);                               \
      for (npy_intp j = 0; j < cols; j++) er[j] = er[j] / s;                                 \
    }                                                                                        \
    return 1;                                                                                \
  }                                                                                          \
  /* s = x * 0.5; tanh(s, s); s *= 0.5; s += 0.5; s *= x. 0: a value that is not finite */   \
  static int silu_##T(const T *x, T *s, npy_intp n, loop_t f, void *d) {                     \
    for (npy_intp i = 0; i < n; i++) {                                                       \
      if (!isfinite(x[i])) return 0;                                                         \
      s[i] = x[i] * (T)0.5;                                                                  \
    }                                                                                        \
    run_loop(f, d, (char *)s, n, sizeof(T));                                                 \
    for (npy_intp i = 0; i < n; i++) {                                                       \
      T t = s[i] * (T)0.5;                                                                   \
      t = t + (T)0.5;                                                                        \
      s[i] = t * x[i];                                                                       \
    }                                                                                        \
    return 1;                                                                                \
  }                                                                                          \
  /* cross_entropy without label smoothing: nll[r] = log(0 + pairwise(exp(x - m))) + m - x[label]; \
     0 where ignored (the reference's where), the total 0 + pairwise(nll). The label count, or -1: \
     a label out of range, a NaN, +inf or an all -inf row (the reference decides). */        \
  static npy_intp ce_##T(const T *x, const int64_t *lab, npy_intp rows, npy_intp cols, int64_t ignore, \
                         T *nll, T *e, T *lse, T *total) {                                   \
    npy_intp count = 0;                                                                      \
    for (npy_intp r = 0; r < rows; r++) {                                                    \
      if (lab[r] != ignore && (lab[r] < 0 || lab[r] >= cols)) return -1;                     \
      count += lab[r] != ignore;                                                             \
    }                                                                                        \
    if (!softmax_##T(x, e, rows, cols, NULL, NULL)) return -1;                               \
    run_loop(exp_loop[sizeof(T) == 8], exp_data[sizeof(T) == 8], (char *)e, rows * cols, sizeof(T)); \
    for (npy_intp r = 0; r < rows; r++) lse[r] = (T)0 + pairwise_##T(e + r * cols, cols);   \
    run_loop(log_loop[sizeof(T) == 8], log_data[sizeof(T) == 8], (char *)lse, rows, sizeof(T)); \
    for (npy_intp r = 0; r < rows; r++) {                                                    \
      const T *xr = x + r * cols;                                                            \
      T m = xr[0];                                                                           \
      for (npy_intp j = 0; j < cols; j++) m = xr[j] > m ? xr[j] : m;                         \
      T l = lse[r] + m;                                                                      \
      nll[r] = lab[r] == ignore ? (T)0 : l - xr[lab[r]];                                     \
    }                                                                                        \
    *total = (T)0 + pairwise_##T(nll, rows);                                                 \
    return count;                                                                            \
  }
PAIRWISE(float)
PAIRWISE(double)

/* A twin's arguments by name (positional first, then keywords); 0: a call it leaves to the reference. */
static int parse(PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames, const char *const *names, int n,
                 PyObject **out) {
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs > n || nargs < 2) return 0;
  for (int i = 0; i < n; i++) out[i] = i < nargs ? args[i] : NULL;
  for (Py_ssize_t k = 0; k < nk; k++) {
    int i = (int)nargs;
    while (i < n && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, k), names[i])) i++;
    if (i == n || out[i]) return 0;
    out[i] = args[nargs + k];
  }
  return 1;
}

/* x when a twin handles it: the host numpy module, a C-contiguous native float32/float64 array. */
static PyArrayObject *twin_input(PyObject *xp, PyObject *a, int type) {
  if (xp != np_mod || Py_TYPE(a) != &PyArray_Type) return NULL;
  PyArrayObject *x = (PyArrayObject *)a;
  int t = PyArray_TYPE(x);
  if ((type ? t != type : t != NPY_FLOAT && t != NPY_DOUBLE) || !PyArray_ISCARRAY_RO(x) ||
      !PyArray_ISNOTSWAPPED(x) || PyArray_NDIM(x) < 1 || PyArray_SIZE(x) == 0)
    return NULL;
  return x;
}

#define F32(x) (PyArray_TYPE(x) == NPY_FLOAT)
#define NEW(x, nd) (PyArrayObject *)PyArray_SimpleNew(nd, PyArray_DIMS(x), PyArray_TYPE(x))

static PyObject *softmax(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
  static const char *const names[] = {"xp", "x", "axis"};
  PyObject *a[3];
  PyArrayObject *x = parse(args, nargsf, kwnames, names, 3, a) ? twin_input(a[0], a[1], 0) : NULL;
  long axis = !x || !a[2] ? -1 : PyLong_CheckExact(a[2]) ? PyLong_AsLong(a[2]) : -1000;
  if (PyErr_Occurred()) PyErr_Clear();
  if (x && (axis == -1 || axis == PyArray_NDIM(x) - 1)) {
    npy_intp cols = PyArray_DIM(x, PyArray_NDIM(x) - 1), rows = PyArray_SIZE(x) / cols;
    PyArrayObject *e = NEW(x, PyArray_NDIM(x));
    if (!e) return NULL;
    if (F32(x) ? softmax_float(PyArray_DATA(x), PyArray_DATA(e), rows, cols, exp_loop[0], exp_data[0])
               : softmax_double(PyArray_DATA(x), PyArray_DATA(e), rows, cols, exp_loop[1], exp_data[1]))
      return (PyObject *)e;
    Py_DECREF(e);
  }
  return PyObject_Vectorcall(ref[0], args, nargsf, kwnames);
}

static PyObject *silu(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
  static const char *const names[] = {"xp", "x"};
  PyObject *a[2];
  PyArrayObject *x = parse(args, nargsf, kwnames, names, 2, a) ? twin_input(a[0], a[1], 0) : NULL;
  if (x) {
    PyArrayObject *s = NEW(x, PyArray_NDIM(x));
    if (!s) return NULL;
    if (F32(x) ? silu_float(PyArray_DATA(x), PyArray_DATA(s), PyArray_SIZE(x), tanh_loop[0], tanh_data[0])
               : silu_double(PyArray_DATA(x), PyArray_DATA(s), PyArray_SIZE(x), tanh_loop[1], tanh_data[1]))
      return (PyObject *)s;
    Py_DECREF(s);
  }
  return PyObject_Vectorcall(ref[1], args, nargsf, kwnames);
}

static PyObject *cross_entropy(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
  static const char *const names[] = {"xp", "logits", "labels", "ignore_index", "label_smoothing",
                                      "reduction"};
  PyObject *a[6], *out = NULL;
  PyArrayObject *x = parse(args, nargsf, kwnames, names, 6, a) ? twin_input(a[0], a[1], 0) : NULL;
  PyArrayObject *lab = x && a[2] ? twin_input(a[0], a[2], NPY_INT64) : NULL;
  int nd = x ? PyArray_NDIM(x) : 0, red = -1;  /* 0 none, 1 sum, 2 mean */
  long long ignore = -100;
  if (lab && a[3]) ignore = PyLong_CheckExact(a[3]) ? PyLong_AsLongLong(a[3]) : (lab = NULL, 0);
  if (lab && a[4] && PyObject_IsTrue(a[4])) lab = NULL;  /* label smoothing: the reference */
  if (PyErr_Occurred()) { PyErr_Clear(); lab = NULL; }
  static const char *const reductions[] = {"none", "sum", "mean"};
  for (int r = 0; r < 3 && lab; r++)
    if (!a[5] || (PyUnicode_Check(a[5]) && !PyUnicode_CompareWithASCIIString(a[5], reductions[r])))
      red = a[5] ? r : 2;
  if (lab && red >= 0 && nd >= 2 && PyArray_NDIM(lab) == nd - 1 &&
      !memcmp(PyArray_DIMS(lab), PyArray_DIMS(x), (nd - 1) * sizeof(npy_intp))) {
    npy_intp cols = PyArray_DIM(x, nd - 1), rows = PyArray_SIZE(x) / cols, item = PyArray_ITEMSIZE(x);
    PyArrayObject *nll = red ? NULL : NEW(x, nd - 1);
    char *buf = PyMem_Malloc((rows * cols + 2 * rows + 1) * item);
    if (!buf || (!red && !nll)) { Py_XDECREF(nll); PyMem_Free(buf); return PyErr_NoMemory(); }
    char *n = nll ? PyArray_DATA(nll) : buf + rows * cols * item, *lse = buf + (rows * cols + rows) * item;
    char *tot = lse + rows * item;
    npy_intp count = F32(x)
      ? ce_float(PyArray_DATA(x), PyArray_DATA(lab), rows, cols, ignore, (float *)n, (float *)buf,
                 (float *)lse, (float *)tot)
      : ce_double(PyArray_DATA(x), PyArray_DATA(lab), rows, cols, ignore, (double *)n, (double *)buf,
                  (double *)lse, (double *)tot);
    if (count > 0 || (count == 0 && red < 2)) {
      if (!red) out = (PyObject *)nll, nll = NULL;
      else if ((out = PyArray_SimpleNew(0, NULL, PyArray_TYPE(x)))) {  /* a numpy scalar, as numpy's */
        void *o = PyArray_DATA((PyArrayObject *)out);
        if (F32(x)) *(float *)o = red == 1 ? *(float *)tot : *(float *)tot / (float)count;
        else *(double *)o = red == 1 ? *(double *)tot : *(double *)tot / (double)count;
        out = PyArray_Return((PyArrayObject *)out);
      }
    }
    Py_XDECREF(nll);
    PyMem_Free(buf);
    if (out || PyErr_Occurred()) return out;
  }
  return PyObject_Vectorcall(ref[2], args, nargsf, kwnames);
}

static PyMethodDef methods[] = {
  {"init", init, METH_VARARGS, "init(Tensor, numpy, _local, globals, OpError, *twins)"},
  {"wrap", wrap_data, METH_O, "Tensor._wrap(data)"},
  {"apply", (PyCFunction)(void (*)(void))apply, METH_FASTCALL, "apply(spec, inputs, attrs) -> Tensor | None"},
  {"softmax", (PyCFunction)(void (*)(void))softmax, METH_FASTCALL | METH_KEYWORDS, "softmax's kernel"},
  {"silu", (PyCFunction)(void (*)(void))silu, METH_FASTCALL | METH_KEYWORDS, "silu's kernel"},
  {"cross_entropy", (PyCFunction)(void (*)(void))cross_entropy, METH_FASTCALL | METH_KEYWORDS, "its kernel"},
  {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_llmkit_eager", NULL, -1, methods};

PyMODINIT_FUNC PyInit__llmkit_eager(void) {
  import_array();
  return PyModule_Create(&module);
}
"""

TWINS = ("softmax", "silu", "cross_entropy")  # ops whose reference kernel has an exact C twin above
reference: dict[str, Any] = {}  # op name -> its reference kernel (the twin's fallback)


def load() -> Any:
    """The extension module (built once per source, toolchain, Python and numpy), or None."""
    tc, inc = build.toolchain(), (sysconfig.get_paths()["include"], np.get_include())
    if os.environ.get("LLMKIT_EAGER_EXT") == "0" or tc is None or not os.path.exists(f"{inc[0]}/Python.h"):
        return None
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    ident = "|".join((tc.ident, sys.version, suffix, np.__version__, *inc, SOURCE))
    so = build.cache_dir() / f"eager_{hashlib.sha256(ident.encode()).hexdigest()[:20]}{suffix}"
    flags = (*tc.flags, *(f"-I{i}" for i in inc))
    if not so.exists() and (err := build._compile(dataclasses.replace(tc, flags=flags), SOURCE, so)):
        build.warn_once(
            "eager-ext", f"the eager C fast path failed to compile; ops run in Python.\n{err[:2000]}"
        )
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader("_llmkit_eager", str(so))
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader("_llmkit_eager", loader))
        loader.exec_module(module)
        module.init(Tensor, np, dispatch._local, vars(dispatch), OpError, *(reference[n] for n in TWINS))
    except (ImportError, OSError, RuntimeError, TypeError) as e:
        build.warn_once("eager-ext", f"the eager C fast path does not load ({e}); ops run in Python")
        return None
    return module


def install() -> None:
    """Route eager calls through the extension, and the twins' ops to their twins."""
    for name in TWINS:
        reference.setdefault(name, get(name).kernel)
    ext = load()
    if ext is not None:
        for name in TWINS:
            get(name).kernel = getattr(ext, name)
        dispatch.register_eager_fast(ext.apply, ext.wrap)
