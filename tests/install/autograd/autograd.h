// See rpc/future.h beside this folder.
#error "the outside project's autograd/autograd.h shadowed Tandem's own"
