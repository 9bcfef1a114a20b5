#!/bin/bash
sed -i 's/sotr/sort/' run.sh
