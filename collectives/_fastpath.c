/* The dispatcher's fast path for repeated small GPU collectives, compiled (collectives/_native.py).

   It does exactly what the Python fast path in collectives/dispatch.py (dispatch_tensors) and the
   prepared runner of collectives/algos/_peer.py (PeerAlgorithm.runner) do, on the same tables, so
   that either can serve any call and both see the same state:

     fast_dispatch(comm, op, output, input, reduce_op, algorithm)
         The checks of dispatch_tensors' fast branch, comm._fast's lookup, the sequence number,
         the flight-recorder entry (RECORDER.start_fast, then its end) and the runner's call.
         Returns None when it ran the call, NotImplemented when the call is not one it takes
         (the Python path then runs it, and may fill the tables for the next call).

     fast_verb(op, output, input, reduce_op, group, async_op, algorithm)
         The verbs' way in: the group's communicator found as get_communicator finds it (where
         that is a lookup), then fast_dispatch.

     Runner(ready, err_address, device, slow, in_place)
         A prepared runner: a repeat on tensors whose launch ``ready`` holds (keyed by the
         output's address, or by the output's and input's) is one driver call on torch's
         current stream of ``device``: cuGraphLaunch of the entry's one-kernel graph where it
         has one and the stream is not being captured, else cuLaunchKernel. Anything else (a new
         address, a kernel that reported a timeout in the int32 at ``err_address``) calls
         ``slow``, the Python runner, which plans, remembers or raises, and a failed launch goes
         to the Python launcher, which rebinds a context or raises.

     last_miss() is the source line of the last check that sent a call to Python (for diagnosis).

   No CUDA headers: the driver's cuLaunchKernel, cuGraphLaunch and cuStreamIsCapturing come in as
   addresses (configure()). Every Python object it touches is reached through the C API, so a
   torch or Python without some attribute makes the call fall back to Python rather than
   misbehave.

   Where a change goes. What is data is defined once, in Python, and handed over by configure()
   (collectives/_native.py), which refuses with a ValueError naming it what this file cannot
   follow (the module is then left as it was, and configure_cuda falls back to Python, warning):

     recorder.FIELDS          the flight recorder's entry: record_start writes each value at its
                              name's position (field_names: the names it fills)
     recorder._PROGRESS_SEQ   where a group's progress list holds its last sequence number
     dispatch._FAST_KEY, dispatch._FAST_KEY_OUT_OF_PLACE
                              comm._fast's key: which facts of a call, in which order (build_key;
                              fact_names: the facts it reads)
     dispatch._FAST_BY_VALUE  the reduce ops keyed by value (the others by id)
     dispatch._FAST_RUNNER    the runner's place in comm._fast's values

   A change to any of these is made there alone. Only a field or a fact that this file has no
   name for needs code here as well (record_start, build_key), and configure() says so until it
   has it; layout() reports what configure() read. The rest of dispatch_tensors' fast branch is
   code, here as there, on the same objects (configure() hands them over): async_op false (the
   caller's check for fast_dispatch), the output's type torch.Tensor (tensor_type), no trace hook
   (dispatch._HOOKS), not comm.debug, no call_timeout bound on this thread (_wait._OPEN,
   _wait._LOCAL), output.is_cuda (device_flag), a hit in comm._fast, an input of the output's
   type and dtype, both contiguous and on the current device (current_device), no profiler
   recording (dispatch._profiling) and no NVTX (nvtx: _env.nvtx_enabled(), read once per
   process on both paths); then comm.seq += 1, the entry, the runner, and on an error the
   entry marked failed and dispatch._failed. A change to one of those is made in
   dispatch_tensors and in fast_dispatch below alike; tests/test_native_fastpath.py checks
   that each sends a call to Python, and that both paths key calls alike. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stdint.h>
#include <time.h>

typedef int (*launch_t)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra);
typedef int (*graph_launch_t)(void *exec, void *stream);
typedef int (*is_capturing_t)(void *stream, int *status);

/* What configure() hands over: the objects the Python fast path reads. */
static PyObject *tensor_type, *hooks, *local, *open_bounds, *profiling, *current_device, *current_stream, *recorder,
    *ring, *skipped, *fail, *py_launch, *s_started, *s_completed, *s_failed;
static PyObject *comms, *world_comm, *c10d; /* communicator._COMMS, communicator._WORLD, torch.distributed.distributed_c10d */
static int nvtx_on; /* NVTX ranges wanted (collectives._env.nvtx_enabled(), fixed per process) */
static launch_t cu_launch;
static graph_launch_t cu_graph_launch; /* NULL: ready entries' graphs are not launched */
static is_capturing_t cu_is_capturing;
static unsigned threads;

/* Interned attribute names. */
static PyObject *a_timeout, *a_debug, *a_fast, *a_seq, *a_is_device, *a_dtype, *a_numel, *a_is_contiguous,
    *a_get_device, *a_data_ptr, *a_shape, *a_group_name, *a_global_ranks, *a_enabled, *a_next, *a_ring,
    *a_progress, *a_track, *a_params, *a_world, *a_default_pg, *a_group;

/* What an entry of the flight recorder holds, by the names of recorder.FIELDS: record_start
   fills each of these, at the position configure() finds that name at in FIELDS (``slot``). */
enum { F_GROUP, F_GROUP_RANKS, F_SEQ, F_OP, F_ALGORITHM, F_IN_SHAPE, F_OUT_SHAPE, F_DTYPE, F_REDUCE_OP, F_ROOT,
       F_CALLSITE, F_T_ENQUEUE, F_T_END, F_STATE, F_COUNT };
static const char *const field_names[F_COUNT] = {"group", "group_ranks", "seq", "op", "algorithm", "in_shape",
                                                 "out_shape", "dtype", "reduce_op", "root", "callsite",
                                                 "t_enqueue", "t_end", "state"};
static Py_ssize_t slot[F_COUNT];   /* FIELDS.index(field_names[k]) */
static Py_ssize_t progress_seq;    /* where recorder._progress[group] holds the last sequence number */

/* comm._fast's key, as dispatch._FAST_KEY (in place) and _FAST_KEY_OUT_OF_PLACE lay it out: the
   facts of a call it may hold, by the names those tuples use; configure() reads their order. */
enum { K_OP, K_ALGORITHM, K_REDUCE_OP, K_DTYPE, K_NUMEL, K_INPUT_NUMEL, K_COUNT };
static const char *const fact_names[K_COUNT] = {"op", "algorithm", "reduce_op", "dtype", "numel", "input_numel"};
#define KEY_MAX 16
static int key_in[KEY_MAX], key_out[KEY_MAX];
static Py_ssize_t n_key_in, n_key_out;
static PyObject *by_value;      /* dispatch._FAST_BY_VALUE: reduce ops of these types are keyed by value, others by id */
static Py_ssize_t runner_index; /* dispatch._FAST_RUNNER: the runner's place in comm._fast's values */

static PyTypeObject RunnerType;

typedef struct {
    PyObject_HEAD
    PyObject *ready;        /* _Ready: address (or (out, in) addresses) -> (function, blocks, Prepared, name) */
    PyObject *slow;         /* the Python runner */
    volatile int32_t *err;  /* the communicator's error word (nonzero: a kernel timed out) */
    int device;
    int in_place;
} Runner;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A method call with no arguments; NULL with an exception set on failure. */
static inline PyObject *call0(PyObject *obj, PyObject *name) {
    return PyObject_CallMethodNoArgs(obj, name);
}

static int truthy_attr(PyObject *obj, PyObject *name) { /* 1, 0, or -1 with an exception */
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static int truthy_call(PyObject *fn) {
    PyObject *v = PyObject_CallNoArgs(fn);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static long long long_call(PyObject *obj, PyObject *name) { /* -1 with an exception on failure */
    PyObject *v = call0(obj, name);
    if (v == NULL) return -1;
    long long r = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return r;
}

/* ---------------------------------------------------------------------------------------------
   Runner */

/* Launch the ready entry ``hit`` on the current stream: 0 done, 1 not launched (no exception), -1 error.
   An entry (function, blocks, Prepared, name[, graph handle, graph]) whose graph handle is nonzero
   is launched as that one-kernel graph, unless the stream is being captured (or cannot say),
   where the kernel is launched so that the capture records it. */
static int launch_ready(Runner *self, PyObject *hit) {
    if (!PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) < 4) return 1;
    void *exec = NULL;
    if (cu_graph_launch != NULL && PyTuple_GET_SIZE(hit) >= 6 && PyLong_Check(PyTuple_GET_ITEM(hit, 4)))
        exec = PyLong_AsVoidPtr(PyTuple_GET_ITEM(hit, 4));
    PyObject *fn = PyTuple_GET_ITEM(hit, 0), *blocks = PyTuple_GET_ITEM(hit, 1), *name = PyTuple_GET_ITEM(hit, 3);
    PyObject *params = PyObject_GetAttr(PyTuple_GET_ITEM(hit, 2), a_params);
    PyObject *dev = PyLong_FromLong(self->device);
    PyObject *stream = dev ? PyObject_CallOneArg(current_stream, dev) : NULL;
    void *f = fn ? PyLong_AsVoidPtr(fn) : NULL;
    unsigned long grid = PyLong_AsUnsignedLong(blocks);
    void *p = params ? PyLong_AsVoidPtr(params) : NULL;
    void *s = stream ? PyLong_AsVoidPtr(stream) : NULL;
    int r;
    if (PyErr_Occurred()) { /* something it could not read: the Python runner takes the call */
        PyErr_Clear();
        r = 1;
    } else {
        int rc;
        /* the driver can block while the launch queue is full: other threads run meanwhile, as
           with CuPy's launcher and torch's ops */
        Py_BEGIN_ALLOW_THREADS
        int capturing = 0;
        if (exec != NULL && (cu_is_capturing(s, &capturing) != 0 || capturing != 0)) exec = NULL;
        rc = exec != NULL ? cu_graph_launch(exec, s) : cu_launch(f, (unsigned)grid, 1, 1, threads, 1, 1, 0, s, (void **)p, NULL);
        Py_END_ALLOW_THREADS
        if (rc == 0) {
            r = 0;
        } else {
            /* a failed launch takes the Python launcher: it binds the device's context on a
               thread that has none and tries again, or raises naming the kernel */
            PyObject *res = PyObject_CallFunctionObjArgs(py_launch, fn, blocks, stream, params, name, dev, NULL);
            r = res == NULL ? -1 : 0;
            Py_XDECREF(res);
        }
    }
    Py_XDECREF(params);
    Py_XDECREF(dev);
    Py_XDECREF(stream);
    return r;
}

/* 0 done, -1 exception set. */
static int runner_run(Runner *self, PyObject *out, PyObject *inp) {
    if (!*self->err) {
        PyObject *key = NULL;
        long long a = long_call(out, a_data_ptr);
        if (a == -1 && PyErr_Occurred()) return -1;
        if (self->in_place) {
            key = PyLong_FromLongLong(a);
        } else {
            long long b = long_call(inp, a_data_ptr);
            if (b == -1 && PyErr_Occurred()) return -1;
            key = Py_BuildValue("(LL)", a, b);
        }
        if (key == NULL) return -1;
        PyObject *hit = PyDict_GetItemWithError(self->ready, key); /* borrowed */
        Py_DECREF(key);
        if (hit == NULL && PyErr_Occurred()) return -1;
        if (hit != NULL) {
            Py_INCREF(hit); /* a launch can run Python code that clears ``ready`` */
            int r = launch_ready(self, hit);
            Py_DECREF(hit);
            if (r <= 0) return r;
        }
    }
    PyObject *r = PyObject_CallFunctionObjArgs(self->slow, out, inp, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *Runner_call(PyObject *op, PyObject *args, PyObject *kwargs) {
    PyObject *out, *inp;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Runner takes (output, input) only");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "Runner", 2, 2, &out, &inp)) return NULL;
    if (runner_run((Runner *)op, out, inp) < 0) return NULL;
    Py_RETURN_NONE;
}

static int Runner_init(Runner *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"ready", "err_address", "device", "slow", "in_place", NULL};
    PyObject *ready, *slow;
    unsigned long long err;
    int device, in_place;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OKiOp", names, &ready, &err, &device, &slow, &in_place))
        return -1;
    if (!PyDict_Check(ready) || !PyCallable_Check(slow) || err == 0) {
        PyErr_SetString(PyExc_TypeError, "Runner(ready: dict, err_address: nonzero int, device: int, slow: callable, in_place: bool)");
        return -1;
    }
    Py_INCREF(ready);
    Py_INCREF(slow);
    Py_XSETREF(self->ready, ready);
    Py_XSETREF(self->slow, slow);
    self->err = (volatile int32_t *)(uintptr_t)err;
    self->device = device;
    self->in_place = in_place;
    return 0;
}

static int Runner_traverse(Runner *self, visitproc visit, void *arg) {
    Py_VISIT(self->ready);
    Py_VISIT(self->slow);
    return 0;
}

static int Runner_clear(Runner *self) {
    Py_CLEAR(self->ready);
    Py_CLEAR(self->slow);
    return 0;
}

static void Runner_dealloc(Runner *self) {
    PyObject_GC_UnTrack(self);
    Runner_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Runner_get_ready(Runner *self, void *closure) {
    Py_INCREF(self->ready);
    return self->ready;
}

static PyGetSetDef Runner_getset[] = {
    {"ready", (getter)Runner_get_ready, NULL, "the prepared launches (address(es) -> launch)", NULL},
    {NULL},
};

static PyTypeObject RunnerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._fastpath.Runner",
    .tp_basicsize = sizeof(Runner),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A prepared peer-memory runner: run(output, input).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Runner_init,
    .tp_call = Runner_call,
    .tp_traverse = (traverseproc)Runner_traverse,
    .tp_clear = (inquiry)Runner_clear,
    .tp_dealloc = (destructor)Runner_dealloc,
    .tp_getset = Runner_getset,
};

/* ---------------------------------------------------------------------------------------------
   fast_dispatch */

/* Whether a code object's file is one of ``skipped`` (the package's own frames), remembered in a
   small direct-mapped table that holds the code objects it names (call sites are few). */
#define INSIDE_SLOTS 256
static struct {
    PyObject *code;
    int inside;
} inside_cache[INSIDE_SLOTS];

static int is_inside(PyCodeObject *code) { /* 1, 0, or -1 with an exception */
    size_t slot = ((uintptr_t)code >> 4) % INSIDE_SLOTS;
    if (inside_cache[slot].code == (PyObject *)code) return inside_cache[slot].inside;
    int inside = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(skipped) && !inside; i++) {
        Py_ssize_t m = PyUnicode_Tailmatch(code->co_filename, PyTuple_GET_ITEM(skipped, i), 0, PY_SSIZE_T_MAX, -1);
        if (m < 0) return -1;
        inside = m > 0;
    }
    Py_INCREF(code);
    Py_XSETREF(inside_cache[slot].code, (PyObject *)code);
    inside_cache[slot].inside = inside;
    return inside;
}

/* The last call site's pair, reused while calls come from the same place (a loop): it holds its
   code object, so the address compared cannot be another's. */
static PyObject *last_site;
static PyCodeObject *last_code;
static int last_lasti = -1;

/* (code, instruction offset) of the first frame outside the package (recorder._callsite), or
   None; the line is worked out when the entry is read. New reference. */
static PyObject *callsite(void) {
    PyFrameObject *f = PyEval_GetFrame(); /* borrowed */
    Py_XINCREF(f);
    while (f != NULL) {
        PyCodeObject *code = PyFrame_GetCode(f);
        int inside = is_inside(code);
        if (inside <= 0) {
            PyObject *r = NULL;
            if (inside == 0) {
                int lasti = PyFrame_GetLasti(f);
                if (code == last_code && lasti == last_lasti) {
                    r = Py_NewRef(last_site);
                } else if ((r = Py_BuildValue("(Oi)", (PyObject *)code, lasti)) != NULL) {
                    Py_XSETREF(last_site, Py_NewRef(r));
                    last_code = code;
                    last_lasti = lasti;
                }
            }
            Py_DECREF(code);
            Py_DECREF(f);
            return r;
        }
        Py_DECREF(code);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_RETURN_NONE;
}

/* RECORDER.start_fast: the entry (borrowed from the ring), Py_None while recording is off, NULL on error. */
static PyObject *record_start(PyObject *comm, PyObject *op, PyObject *algorithm, PyObject *output, PyObject *input,
                              PyObject *reduce_op, PyObject *dtype, PyObject *seq) {
    int on = truthy_attr(recorder, a_enabled);
    if (on <= 0) return on < 0 ? NULL : Py_None;
    PyObject *next = PyObject_GetAttr(recorder, a_next);
    PyObject *entry = NULL, *after = NULL;
    long long n = next ? PyLong_AsLongLong(next) : -1;
    if (n < 0 || (after = PyLong_FromLongLong(n + 1)) == NULL || PyObject_SetAttr(recorder, a_next, after) < 0)
        goto done;
    entry = PyList_GET_ITEM(ring, n % PyList_GET_SIZE(ring)); /* the ring has ``capacity`` slots */
    if (!PyList_Check(entry) || PyList_GET_SIZE(entry) != F_COUNT) {
        entry = NULL;
        goto done;
    }
    PyObject *group = PyObject_GetAttr(comm, a_group_name);
    PyObject *ranks = PyObject_GetAttr(comm, a_global_ranks);
    PyObject *out_shape = PyObject_GetAttr(output, a_shape);
    PyObject *in_shape = input == output ? (Py_XINCREF(out_shape), out_shape) : PyObject_GetAttr(input, a_shape);
    PyObject *site = callsite();
    PyObject *t = PyFloat_FromDouble(now());
    if (!group || !ranks || !out_shape || !in_shape || !site || !t) {
        Py_XDECREF(group); Py_XDECREF(ranks); Py_XDECREF(out_shape); Py_XDECREF(in_shape);
        Py_XDECREF(site); Py_XDECREF(t);
        entry = NULL;
        goto done;
    }
    PyObject *values[F_COUNT]; /* new references, one per field (in this file's order) */
    values[F_GROUP] = group;
    values[F_GROUP_RANKS] = ranks;
    values[F_SEQ] = Py_NewRef(seq);
    values[F_OP] = Py_NewRef(op);
    values[F_ALGORITHM] = Py_NewRef(algorithm);
    values[F_IN_SHAPE] = in_shape;
    values[F_OUT_SHAPE] = out_shape;
    values[F_DTYPE] = Py_NewRef(dtype);
    values[F_REDUCE_OP] = Py_NewRef(reduce_op);
    values[F_ROOT] = Py_NewRef(Py_None);
    values[F_CALLSITE] = site;
    values[F_T_ENQUEUE] = t;
    values[F_T_END] = Py_NewRef(Py_None);
    values[F_STATE] = Py_NewRef(s_started);
    for (int k = 0; k < F_COUNT; k++) PyList_SetItem(entry, slot[k], values[k]); /* steals */
    /* the progress the recorder publishes per group (recorder._PROGRESS_SEQ holds the last seq) */
    PyObject *progress = PyObject_GetAttr(recorder, a_progress);
    PyObject *mine = progress ? PyDict_GetItemWithError(progress, group) : NULL; /* borrowed */
    if (mine != NULL && PyList_Check(mine) && PyList_GET_SIZE(mine) > progress_seq) {
        Py_INCREF(seq);
        PyList_SetItem(mine, progress_seq, seq);
    } else if (progress != NULL && !PyErr_Occurred()) {
        PyObject *r = PyObject_CallMethodObjArgs(recorder, a_track, comm, seq, NULL);
        Py_XDECREF(r);
    }
    Py_XDECREF(progress);
    if (PyErr_Occurred()) entry = NULL;
done:
    Py_XDECREF(next);
    Py_XDECREF(after);
    return entry;
}

static void record_end(PyObject *entry, PyObject *state) {
    if (entry == Py_None) return;
    PyObject *t = PyFloat_FromDouble(now());
    if (t == NULL) {
        PyErr_Clear();
        return;
    }
    PyList_SetItem(entry, slot[F_T_END], t);
    Py_INCREF(state);
    PyList_SetItem(entry, slot[F_STATE], state);
}

/* 1: the checks of dispatch_tensors' fast branch pass for ``t``; 0: they do not; -1: error. */
static int tensor_ok(PyObject *t, long long device) {
    PyObject *v = call0(t, a_is_contiguous);
    if (v == NULL) return -1;
    int contiguous = v == Py_True;
    Py_DECREF(v);
    if (!contiguous) return 0;
    long long d = long_call(t, a_get_device);
    if (d == -1 && PyErr_Occurred()) return -1;
    return d == device;
}

/* comm._fast's key for the call (dispatch._fast_key); NULL where it has none: the input is not
   a tensor (no exception), or something could not be read (an exception). Sets ``*dtype`` to
   output.dtype (a new reference) on success. Inlined into fast_dispatch: called, it cost about
   1% of a call (CPU, launch/bench_fastpath_host.py). */
static inline __attribute__((always_inline)) PyObject *build_key(PyObject *op, PyObject *output, PyObject *input,
                                                                 PyObject *reduce_op, PyObject *algorithm,
                                                                 PyObject **dtype) {
    PyObject *facts[K_COUNT] = {op, algorithm, NULL, NULL, NULL, NULL};
    PyObject *key = NULL;
    long long n, m;
    const int *spec = input == output ? key_in : key_out;
    Py_ssize_t len = input == output ? n_key_in : n_key_out;
    int in_place = input == output;
    if (!in_place && Py_TYPE(input) != (PyTypeObject *)tensor_type) return NULL;
    int keep = 0; /* by value: the reduce op as given; else its id (a ReduceOp member hashes slowly) */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(by_value) && !keep; i++)
        keep = Py_TYPE(reduce_op) == (PyTypeObject *)PyTuple_GET_ITEM(by_value, i);
    if ((facts[K_REDUCE_OP] = keep ? Py_NewRef(reduce_op) : PyLong_FromVoidPtr(reduce_op)) == NULL) goto done;
    if ((facts[K_DTYPE] = PyObject_GetAttr(output, a_dtype)) == NULL) goto done;
    n = long_call(output, a_numel);
    if ((n == -1 && PyErr_Occurred()) || (facts[K_NUMEL] = PyLong_FromLongLong(n)) == NULL) goto done;
    if (in_place) {
        facts[K_INPUT_NUMEL] = Py_NewRef(facts[K_NUMEL]);
    } else {
        m = long_call(input, a_numel);
        if ((m == -1 && PyErr_Occurred()) || (facts[K_INPUT_NUMEL] = PyLong_FromLongLong(m)) == NULL) goto done;
    }
    if ((key = PyTuple_New(len)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < len; i++) PyTuple_SET_ITEM(key, i, Py_NewRef(facts[spec[i]]));
    *dtype = Py_NewRef(facts[K_DTYPE]);
done:
    for (int k = K_REDUCE_OP; k < K_COUNT; k++) Py_XDECREF(facts[k]);
    return key;
}

static int miss_line;
#define MISS_IF(cond) do { if (cond) { miss_line = __LINE__; goto miss; } } while (0)

static PyObject *fast_dispatch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "fast_dispatch(comm, op, output, input, reduce_op, algorithm)");
        return NULL;
    }
    if (tensor_type == NULL) Py_RETURN_NOTIMPLEMENTED;
    PyObject *comm = args[0], *op = args[1], *output = args[2], *input = args[3], *reduce_op = args[4],
             *algorithm = args[5];
    PyObject *key = NULL, *dtype = NULL, *fast = NULL, *hit = NULL, *seq = NULL;
    int r;

    MISS_IF(Py_TYPE(output) != (PyTypeObject *)tensor_type || PyList_GET_SIZE(hooks) != 0);
    MISS_IF((r = truthy_attr(comm, a_debug)) != 0);
    if (PyLong_AsLong(PyList_GET_ITEM(open_bounds, 0)) != 0) { /* a call_timeout block is open somewhere */
        PyObject *bound = PyObject_GetAttr(local, a_timeout); /* this thread's bound */
        int unbounded = bound == Py_None;
        Py_XDECREF(bound);
        MISS_IF(!unbounded);
    }
    MISS_IF((r = truthy_attr(output, a_is_device)) != 1);

    key = build_key(op, output, input, reduce_op, algorithm, &dtype);
    MISS_IF(key == NULL);
    fast = PyObject_GetAttr(comm, a_fast);
    MISS_IF(fast == NULL || !PyDict_Check(fast));
    PyObject *found = PyDict_GetItemWithError(fast, key); /* borrowed */
    MISS_IF(found == NULL || !PyTuple_Check(found) || PyTuple_GET_SIZE(found) <= runner_index);
    hit = Py_NewRef(found); /* the runner's call may clear comm._fast */

    PyObject *cur = PyObject_CallNoArgs(current_device);
    long long device = cur ? PyLong_AsLongLong(cur) : -1;
    Py_XDECREF(cur);
    MISS_IF(PyErr_Occurred());
    MISS_IF((r = tensor_ok(output, device)) != 1);
    if (input != output) {
        PyObject *in_dtype = PyObject_GetAttr(input, a_dtype);
        int same = in_dtype == dtype;
        Py_XDECREF(in_dtype);
        MISS_IF(!same);
        MISS_IF((r = tensor_ok(input, device)) != 1);
    }
    MISS_IF(nvtx_on || (r = truthy_call(profiling)) != 0);

    /* from here on the call is ours: count it, record it, run it */
    PyObject *runner = PyTuple_GET_ITEM(hit, runner_index);
    PyObject *last = PyObject_GetAttr(comm, a_seq);
    PyObject *one = PyLong_FromLong(1);
    seq = (last && one) ? PyNumber_Add(last, one) : NULL;
    Py_XDECREF(last);
    Py_XDECREF(one);
    if (seq == NULL || PyObject_SetAttr(comm, a_seq, seq) < 0) goto error;
    PyObject *entry = record_start(comm, op, algorithm, output, input, reduce_op, dtype, seq);
    if (entry == NULL) goto error;
    Py_INCREF(entry);
    int ran = Py_TYPE(runner) == &RunnerType ? runner_run((Runner *)runner, output, input) : 0;
    if (Py_TYPE(runner) != &RunnerType) {
        PyObject *res = PyObject_CallFunctionObjArgs(runner, output, input, NULL);
        ran = res == NULL ? -1 : 0;
        Py_XDECREF(res);
    }
    if (ran < 0) {
        /* RECORDER.end(entry, "failed"), then dispatch._failed (dump; a timeout becomes
           CollectiveTimeout naming the ranks that never arrived), then raise */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL) PyException_SetTraceback(value, tb);
        record_end(entry, s_failed);
        Py_DECREF(entry);
        PyObject *res = PyObject_CallFunctionObjArgs(fail, comm, op, seq, value, NULL);
        if (res != NULL) { /* _failed returned: the original error stands */
            Py_DECREF(res);
            PyErr_Restore(type, value, tb);
        } else {
            Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
        }
        goto error;
    }
    record_end(entry, s_completed);
    Py_DECREF(entry);
    Py_XDECREF(key); Py_XDECREF(dtype); Py_XDECREF(fast); Py_XDECREF(hit); Py_XDECREF(seq);
    Py_RETURN_NONE;

miss:
    /* not a call this path takes (or something it reads is missing): the Python path runs it */
    PyErr_Clear();
    Py_XDECREF(key); Py_XDECREF(dtype); Py_XDECREF(fast); Py_XDECREF(hit); Py_XDECREF(seq);
    Py_RETURN_NOTIMPLEMENTED;
error:
    Py_XDECREF(key); Py_XDECREF(dtype); Py_XDECREF(fast); Py_XDECREF(hit); Py_XDECREF(seq);
    return NULL;
}

/* communicator.get_communicator(group) where it is a lookup (a borrowed reference), else NULL
   with no exception: the default group's communicator while it is still torch's default group
   (GroupMember.WORLD), or a group's cached one. */
static PyObject *find_comm(PyObject *group) {
    if (comms == NULL) return NULL;
    PyObject *holder = PyObject_GetAttr(c10d, a_world);
    PyObject *world = holder ? PyObject_GetAttr(holder, a_default_pg) : NULL;
    Py_XDECREF(holder);
    if (world == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *comm = NULL;
    if (group == Py_None || group == world) {
        if (PyList_GET_SIZE(world_comm) > 0) {
            PyObject *c = PyList_GET_ITEM(world_comm, 0);
            PyObject *g = PyObject_GetAttr(c, a_group);
            if (g == world) comm = c;
            Py_XDECREF(g);
        }
    } else {
        /* _COMMS is a WeakKeyDictionary; ``comms`` is its dict of weak references (a weak
           reference hashes and compares as its referent; the plain one is shared, so this
           allocates nothing after the first call) */
        PyObject *ref = PyWeakref_NewRef(group, NULL);
        comm = ref ? PyDict_GetItemWithError(comms, ref) : NULL; /* borrowed */
        Py_XDECREF(ref);
    }
    Py_DECREF(world);
    PyErr_Clear();
    return comm;
}

static PyObject *fast_verb(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "fast_verb(op, output, input, reduce_op, group, async_op, algorithm)");
        return NULL;
    }
    if (args[5] != Py_False || tensor_type == NULL) Py_RETURN_NOTIMPLEMENTED;
    PyObject *comm = find_comm(args[4]);
    if (comm == NULL) Py_RETURN_NOTIMPLEMENTED;
    PyObject *call[6] = {comm, args[0], args[1], args[2], args[3], args[6]};
    return fast_dispatch(module, call, 6);
}

/* ``fields`` (recorder.FIELDS) into ``out``: each name's position, every name this file fills
   present once and no other; 0, or -1 with ValueError naming the field (nothing is changed). */
static int read_fields(PyObject *fields, Py_ssize_t out[F_COUNT]) {
    if (!PyTuple_Check(fields)) {
        PyErr_SetString(PyExc_TypeError, "fields must be recorder.FIELDS, a tuple of str");
        return -1;
    }
    for (int k = 0; k < F_COUNT; k++) out[k] = -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields); i++) {
        PyObject *name = PyTuple_GET_ITEM(fields, i);
        int k = 0;
        while (k < F_COUNT && !(PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, field_names[k]) == 0)) k++;
        if (k == F_COUNT || out[k] != -1) {
            PyErr_Format(PyExc_ValueError, "recorder.FIELDS[%zd] is %R, %s: the compiled fast path cannot write "
                         "this layout; teach record_start in collectives/_fastpath.c to fill it (or set "
                         "COMMOPS_NATIVE=0)", i, name, k == F_COUNT ? "a field it does not fill" : "a second time");
            return -1;
        }
        out[k] = i;
    }
    for (int k = 0; k < F_COUNT; k++) {
        if (out[k] == -1) {
            PyErr_Format(PyExc_ValueError, "recorder.FIELDS has no %s, which the compiled fast path fills: remove "
                         "it from record_start in collectives/_fastpath.c (or set COMMOPS_NATIVE=0)", field_names[k]);
            return -1;
        }
    }
    return 0;
}

/* ``spec`` (dispatch._FAST_KEY or _FAST_KEY_OUT_OF_PLACE, named ``what``) into ``out``/``n``: each
   name's fact; 0, or -1 with ValueError naming one this file does not build (nothing is changed). */
static int read_key(PyObject *spec, const char *what, int out[KEY_MAX], Py_ssize_t *n) {
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) > KEY_MAX) {
        PyErr_Format(PyExc_TypeError, "dispatch.%s must be a tuple of at most %d str", what, KEY_MAX);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(spec); i++) {
        PyObject *name = PyTuple_GET_ITEM(spec, i);
        int k = 0;
        while (k < K_COUNT && !(PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, fact_names[k]) == 0)) k++;
        if (k == K_COUNT) {
            PyErr_Format(PyExc_ValueError, "dispatch.%s[%zd] is %R, a fact of a call the compiled fast path does "
                         "not read: teach build_key in collectives/_fastpath.c to (or set COMMOPS_NATIVE=0)", what,
                         i, name);
            return -1;
        }
        out[i] = k;
    }
    *n = PyTuple_GET_SIZE(spec);
    return 0;
}

static PyObject *configure(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"tensor_type", "hooks", "local", "open_bounds", "profiling", "nvtx",
                            "current_device", "current_stream", "recorder", "skipped", "fail", "py_launch",
                            "launch_address", "threads", "device_flag", "comms", "world", "c10d",
                            "fields", "progress_seq", "fast_key", "fast_key_out_of_place", "by_value",
                            "runner_index", "graph_launch_address", "capturing_address", NULL};
    PyObject *o[11], *flag, *cm, *wc, *cd, *fields, *spec_in, *spec_out, *bv; /* comms: a dict */
    unsigned long long addr, graph_addr = 0, capturing_addr = 0;
    unsigned t;
    int nvtx, new_in[KEY_MAX], new_out[KEY_MAX];
    Py_ssize_t p_seq, r_index, new_slot[F_COUNT], new_n_in, new_n_out;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OO!OpOOOO!OOKIUO!O!OOnOOO!n|KK", names, &o[0], &PyList_Type,
                                     &o[1], &o[2], &PyList_Type, &o[3], &o[4], &nvtx, &o[5], &o[6], &o[7],
                                     &PyTuple_Type, &o[8], &o[9], &o[10], &addr, &t, &flag, &PyDict_Type, &cm,
                                     &PyList_Type, &wc, &cd, &fields, &p_seq, &spec_in, &spec_out, &PyTuple_Type, &bv,
                                     &r_index, &graph_addr, &capturing_addr))
        return NULL;
    /* the definitions first: a refused one leaves the module as it was */
    if (read_fields(fields, new_slot) < 0 || read_key(spec_in, "_FAST_KEY", new_in, &new_n_in) < 0 ||
        read_key(spec_out, "_FAST_KEY_OUT_OF_PLACE", new_out, &new_n_out) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(bv); i++) {
        if (!PyType_Check(PyTuple_GET_ITEM(bv, i))) {
            PyErr_SetString(PyExc_TypeError, "by_value must be dispatch._FAST_BY_VALUE, a tuple of types");
            return NULL;
        }
    }
    if (p_seq < 0 || r_index < 0) {
        PyErr_SetString(PyExc_ValueError, "progress_seq and runner_index must be indices (recorder._PROGRESS_SEQ, "
                        "dispatch._FAST_RUNNER)");
        return NULL;
    }
    if (addr == 0) {
        PyErr_SetString(PyExc_ValueError, "launch_address is 0: pass the address of cuLaunchKernel");
        return NULL;
    }
    PyObject *r = PyObject_GetAttr(o[7], a_ring);
    if (r == NULL) return NULL;
    if (!PyList_Check(r) || PyList_GET_SIZE(r) == 0 || PyList_GET_SIZE(o[3]) != 1) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_TypeError, "recorder._ring must be a non-empty list and open_bounds a list of one int");
        return NULL;
    }
    Py_XSETREF(ring, r);
    Py_INCREF(cm);
    Py_INCREF(wc);
    Py_INCREF(cd);
    Py_XSETREF(comms, cm);
    Py_XSETREF(world_comm, wc);
    Py_XSETREF(c10d, cd);
    nvtx_on = nvtx;
    Py_INCREF(flag);
    PyUnicode_InternInPlace(&flag);
    Py_XSETREF(a_is_device, flag);
    PyObject **slots[11] = {&tensor_type, &hooks, &local, &open_bounds, &profiling, &current_device,
                            &current_stream, &recorder, &skipped, &fail, &py_launch};
    for (int i = 0; i < 11; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*slots[i], o[i]);
    }
    for (int i = 0; i < INSIDE_SLOTS; i++) Py_CLEAR(inside_cache[i].code); /* judged against the old ``skipped`` */
    for (int k = 0; k < F_COUNT; k++) slot[k] = new_slot[k];
    progress_seq = p_seq;
    for (Py_ssize_t i = 0; i < new_n_in; i++) key_in[i] = new_in[i];
    for (Py_ssize_t i = 0; i < new_n_out; i++) key_out[i] = new_out[i];
    n_key_in = new_n_in;
    n_key_out = new_n_out;
    Py_INCREF(bv);
    Py_XSETREF(by_value, bv);
    runner_index = r_index;
    cu_launch = (launch_t)(uintptr_t)addr;
    /* graphs only with both: a graph cannot be launched into a capture, which must be asked first */
    cu_graph_launch = graph_addr && capturing_addr ? (graph_launch_t)(uintptr_t)graph_addr : NULL;
    cu_is_capturing = cu_graph_launch ? (is_capturing_t)(uintptr_t)capturing_addr : NULL;
    threads = t;
    Py_RETURN_NONE;
}

static PyObject *last_miss(PyObject *module, PyObject *unused) { return PyLong_FromLong(miss_line); }

/* What configure() read off the Python definitions, for tests and diagnosis. */
static PyObject *layout(PyObject *module, PyObject *unused) {
    if (tensor_type == NULL) Py_RETURN_NONE; /* not configured */
    PyObject *fields = PyDict_New();
    if (fields == NULL) return NULL;
    for (int k = 0; k < F_COUNT; k++) {
        PyObject *i = PyLong_FromSsize_t(slot[k]);
        if (i == NULL || PyDict_SetItemString(fields, field_names[k], i) < 0) {
            Py_XDECREF(i);
            Py_DECREF(fields);
            return NULL;
        }
        Py_DECREF(i);
    }
    PyObject *specs[2] = {PyTuple_New(n_key_in), PyTuple_New(n_key_out)};
    for (int j = 0; j < 2; j++) {
        const int *spec = j == 0 ? key_in : key_out;
        for (Py_ssize_t i = 0; specs[j] != NULL && i < PyTuple_GET_SIZE(specs[j]); i++) {
            PyObject *name = PyUnicode_FromString(fact_names[spec[i]]);
            if (name == NULL) Py_CLEAR(specs[j]);
            else PyTuple_SET_ITEM(specs[j], i, name);
        }
    }
    if (specs[0] == NULL || specs[1] == NULL) {
        Py_DECREF(fields);
        Py_XDECREF(specs[0]);
        Py_XDECREF(specs[1]);
        return NULL;
    }
    return Py_BuildValue("{sNsnsNsNsOsn}", "fields", fields, "progress_seq", progress_seq, "fast_key", specs[0],
                         "fast_key_out_of_place", specs[1], "by_value", by_value, "runner_index", runner_index);
}

/* comm._fast's key as the compiled path builds it for a call, or None where it has none. */
static PyObject *fast_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "fast_key(op, output, input, reduce_op, algorithm)");
        return NULL;
    }
    if (tensor_type == NULL) Py_RETURN_NONE;
    PyObject *dtype = NULL;
    PyObject *key = build_key(args[0], args[1], args[2], args[3], args[4], &dtype);
    Py_XDECREF(dtype);
    if (key == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return key;
}

static PyMethodDef methods[] = {
    {"last_miss", (PyCFunction)last_miss, METH_NOARGS, "the source line of the last check that sent a call to Python"},
    {"layout", (PyCFunction)layout, METH_NOARGS,
     "what configure() read off recorder.py and dispatch.py (None before it): {'fields': {recorder field name: "
     "index}, 'progress_seq', 'fast_key', 'fast_key_out_of_place', 'by_value', 'runner_index'}"},
    {"fast_key", (PyCFunction)(void (*)(void))fast_key, METH_FASTCALL,
     "fast_key(op, output, input, reduce_op, algorithm): comm._fast's key for the call as fast_dispatch builds "
     "it, or None where it has none (for tests and diagnosis)"},
    {"fast_dispatch", (PyCFunction)(void (*)(void))fast_dispatch, METH_FASTCALL,
     "fast_dispatch(comm, op, output, input, reduce_op, algorithm) -> None (ran) or NotImplemented"},
    {"fast_verb", (PyCFunction)(void (*)(void))fast_verb, METH_FASTCALL,
     "fast_verb(op, output, input, reduce_op, group, async_op, algorithm): fast_dispatch with the group's "
     "communicator found as get_communicator finds it; NotImplemented where it is not a lookup"},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(**objects the fast path reads; see collectives/_native.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpath", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastpath(void) {
#define INTERN(var, s) if ((var = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(a_timeout, "timeout"); INTERN(a_debug, "debug"); INTERN(a_fast, "_fast"); INTERN(a_seq, "seq");
    INTERN(a_dtype, "dtype"); INTERN(a_numel, "numel");
    INTERN(a_is_contiguous, "is_contiguous"); INTERN(a_get_device, "get_device"); INTERN(a_data_ptr, "data_ptr");
    INTERN(a_shape, "shape"); INTERN(a_group_name, "_group_name"); INTERN(a_global_ranks, "global_ranks");
    INTERN(a_enabled, "enabled"); INTERN(a_next, "_next"); INTERN(a_ring, "_ring"); 
    INTERN(a_progress, "_progress"); INTERN(a_track, "_track"); INTERN(a_params, "params");
    INTERN(a_world, "_world"); INTERN(a_default_pg, "default_pg"); INTERN(a_group, "group");
    INTERN(s_started, "started"); INTERN(s_completed, "completed"); INTERN(s_failed, "failed");
#undef INTERN
    if (PyType_Ready(&RunnerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RunnerType);
    if (PyModule_AddObject(m, "Runner", (PyObject *)&RunnerType) < 0) {
        Py_DECREF(&RunnerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
