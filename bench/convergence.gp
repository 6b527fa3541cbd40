# Training loss against optimizer step for every schedule, from
# bench/convergence.sh's curves (N = 1; one panel per P and optimizer).
#   gnuplot -e "dir='out/convergence'" bench/convergence.gp   (writes docs/convergence.png)
if (!exists("dir")) dir = "out/convergence"
if (!exists("png")) png = "docs/convergence.png"
set terminal pngcairo size 1400,1000 font ",11"
set output png
set multiplot layout 2,2 title "PipeMare vs GPipe, PipeDream and naive async: fine-grained MLP on MNIST, one stage per layer (N = 1)"
set logscale y
set yrange [0.1:1e4]  # diverged runs leave the top; their status says FAILED
set xlabel "optimizer step"
set ylabel "training loss (window mean)"
set key top right
set grid
schedules = "gpipe pipemare pipedream async"
do for [p in "8 16"] {
  do for [opt in "momentum plain"] {
    set title sprintf("P = %s, %s", p, opt eq "momentum" ? "SGD, momentum 0.9" : "SGD, no momentum")
    plot for [s in schedules] sprintf("%s/p%s-n1-%s-%s.curve", dir, p, opt, s) \
      using 1:2 with lines lw 2 title s
  }
}
unset multiplot
